"""Whether a config can run (``lnstrain.config.feasibility``): the optimizer DeepSpeed wraps ours in for each
precision × ZeRO × pipeline, who clips, and a launch's list of problems naming each problem once."""

import pytest

from lnstrain.config.deepspeed_json import deepspeed_config
from lnstrain.config.feasibility import OptimizerKind, asks_fp32_accumulation, optimizer_kind, world_size_problems
from lnstrain.config.run_config import config_from_dict, read_config
from lnstrain.estimate.memory import memory_estimate
from lnstrain.parallel.groups import layout_problems as group_layout_problems
from lnstrain.training import preflight

TINY = {"model": {"preset": "tiny"}, "data": {"seq_len": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 10}}

NONE, FP16_UNFUSED, BF16_OPTIMIZER = OptimizerKind.NONE, OptimizerKind.FP16_UNFUSED, OptimizerKind.BF16_OPTIMIZER
ZERO, ZERO3 = OptimizerKind.ZERO, OptimizerKind.ZERO3
# (zero stage, pipeline) -> the optimizer DeepSpeed 0.19 wraps ours in, per precision (ZeRO 2/3 take no pipeline)
LAYOUTS = [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (3, 1)]
EXPECTED = {
    ("fp32", True): [NONE, NONE, ZERO, ZERO, ZERO, ZERO3],
    ("bf16", True): [FP16_UNFUSED, BF16_OPTIMIZER, BF16_OPTIMIZER, BF16_OPTIMIZER, ZERO, ZERO3],
    ("bf16", False): [FP16_UNFUSED, BF16_OPTIMIZER, ZERO, ZERO, ZERO, ZERO3],
    ("fp16", True): [FP16_UNFUSED, FP16_UNFUSED, ZERO, ZERO, ZERO, ZERO3],
}
CASES = [(dtype, accum, zero, pipeline, kinds[index]) for (dtype, accum), kinds in EXPECTED.items()
         for index, (zero, pipeline) in enumerate(LAYOUTS)]


def _config(dtype: str, fp32_grad_accum: bool, zero_stage: int, pipeline: int, **sections):
    return config_from_dict({**TINY, "precision": {"dtype": dtype, "fp32_grad_accum": fp32_grad_accum},
                             "parallel": {"zero_stage": zero_stage, "pipeline": pipeline}, **sections})


@pytest.mark.parametrize("dtype, fp32_grad_accum, zero_stage, pipeline, expected", CASES)
def test_optimizer_kind_across_precision_zero_and_pipeline(dtype, fp32_grad_accum, zero_stage, pipeline, expected):
    config = _config(dtype, fp32_grad_accum, zero_stage, pipeline)
    kind = optimizer_kind(config)
    assert kind is expected
    assert kind.lnstrain_clips == (dtype == "fp32" and zero_stage == 0)
    # the DeepSpeed JSON and the memory estimate read the same answer
    ds = deepspeed_config(config, world_size=pipeline)
    assert ds["gradient_clipping"] == (0.0 if kind.lnstrain_clips else config.optim.grad_clip)
    assert ("data_types" in ds) == asks_fp32_accumulation(config) == (dtype == "bf16" and fp32_grad_accum
                                                                      and zero_stage > 0)
    assert memory_estimate(config, world_size=pipeline).optimizer_kind is kind


def test_deepspeed_clips_nowhere_lnstrain_does_even_if_the_pass_through_asks():
    clipped_twice = _config("fp32", True, 0, 1, deepspeed={"gradient_clipping": 0.5})
    assert deepspeed_config(clipped_twice, world_size=1)["gradient_clipping"] == 0.0
    zero1 = _config("fp32", True, 1, 1, deepspeed={"gradient_clipping": 0.5})
    assert deepspeed_config(zero1, world_size=1)["gradient_clipping"] == 0.5


def test_the_world_size_rule_is_the_same_for_the_config_and_the_process_groups():
    [problem] = world_size_problems(6, 4, 1)
    assert problem == "world size 6 is not divisible by parallel.tensor × parallel.pipeline (4 × 1); launch a " \
                      "multiple of 4 ranks"
    assert group_layout_problems(6, 4, 1) == [problem]
    assert problem in config_from_dict({**TINY, "parallel": {"tensor": 4}}).validate(world_size=6)


FP16_ZERO0 = "precision.dtype fp16 with parallel.zero_stage 0"
BF16_ACCUMULATION = "precision.dtype bf16 with precision.fp32_grad_accum and parallel.zero_stage 0 accumulates"
OVERCOUNT = "model.fused_qkv with model.num_kv_heads (1) < parallel.tensor (2)"
WORLD = "world size 3 is not divisible by parallel.tensor × parallel.pipeline (2 × 1)"
SEQ_LEN = "data.seq_len (32) exceeds model.max_seq_len (16)"
SOURCES = "data.sources is empty"
BATCH = "train.global_batch_size (8) must be divisible by"


@pytest.mark.parametrize("sections, world_size, expected", [
    ({"precision": {"dtype": "fp16"}, "parallel": {"tensor": 2, "zero_stage": 0},
      "model": {"preset": "tiny", "num_kv_heads": 1}, "data": {"seq_len": 32}},
     3, [FP16_ZERO0, OVERCOUNT, WORLD, SEQ_LEN, SOURCES]),
    ({"precision": {"dtype": "bf16"}, "parallel": {"tensor": 2, "zero_stage": 0},
      "model": {"preset": "tiny", "num_kv_heads": 1}, "train": {"global_batch_size": 8, "micro_batch_size": 2,
                                                                "steps": 10}},
     2, [BF16_ACCUMULATION, OVERCOUNT, SOURCES]),
    ({"precision": {"dtype": "bf16"}, "parallel": {"zero_stage": 0}}, 3, [BATCH, SOURCES]),
])
def test_each_problem_appears_once_in_the_launchs_list(sections, world_size, expected, tmp_path):
    typed = read_config({**TINY, **sections, "run": {"output_dir": str(tmp_path)}})
    problems = preflight.run_problems(typed, world_size)
    assert len(problems) == len(set(problems)), problems
    for says in expected:
        assert sum(says in problem for problem in problems) == 1, (says, problems)


def test_rules_that_need_no_world_size_apply_without_one():
    problems = _config("fp16", True, 0, 1).validate(check_files=False)
    assert sum(FP16_ZERO0 in problem for problem in problems) == 1
    assert not any("world size" in problem for problem in problems)


@pytest.mark.parametrize("tensor", [3, 8])
def test_heads_that_cannot_be_split_are_one_problem_not_one_per_key_the_user_never_set(tensor):
    """num_kv_heads unset means num_heads: its divisibility (or fused_qkv's overcount) would repeat the line."""
    model = {"preset": "tiny", "num_heads": 4, "num_kv_heads": None, "hidden_size": 64, "ffn_hidden_size": 192,
             "fused_qkv": True}
    problems = config_from_dict({**TINY, "model": model, "parallel": {"tensor": tensor}}).validate(world_size=tensor)
    assert [p for p in problems if "heads" in p] == [f"model.num_heads (4) must be divisible by parallel.tensor ({tensor})"]
    model["num_kv_heads"] = 2  # set by the user: its own line
    problems = config_from_dict({**TINY, "model": model, "parallel": {"tensor": 3}}).validate(world_size=3)
    assert "model.num_kv_heads (2) must divide or be divisible by parallel.tensor (3)" in problems


CONTEXT_WORLD = "world size 6 is not divisible by parallel.tensor × parallel.pipeline × parallel.context (1 × 1 × 4)"
CHUNKS = "data.seq_len (12) must be divisible by 2 × parallel.context (8)"
SP_SHARE = "data.seq_len / parallel.context (8) must be divisible by parallel.tensor (16) with sequence parallelism"
ALL_TO_ALL = "parallel.context_method all_to_all needs the query heads (4) and key/value heads (2) of each tensor rank " \
             "divisible by parallel.context (4)"
DROPOUT = "model.attention_dropout (0.1) must be 0 with parallel.context > 1"


@pytest.mark.parametrize("parallel, model, data, train, world_size, expected", [
    ({"context": 4}, {}, {"seq_len": 12}, {}, 6, [CONTEXT_WORLD, CHUNKS]),
    ({"context": 2, "tensor": 16, "sequence_parallel": True}, {"num_heads": 16, "num_kv_heads": 16, "hidden_size": 64},
     {"seq_len": 16}, {}, 32, [SP_SHARE]),
    ({"context": 4, "context_method": "all_to_all"}, {"attention_dropout": 0.1}, {"seq_len": 16}, {"compile": True},
     4, [ALL_TO_ALL, DROPOUT]),  # compiled layers are not refused: tests/parallel/test_compiled_layouts.py
])
def test_context_parallelism_is_refused_before_launch_where_it_cannot_run(parallel, model, data, train, world_size,
                                                                          expected):
    config = config_from_dict({**TINY, "parallel": parallel, "model": {"preset": "tiny", **model},
                               "data": {**data, "sources": [{"prefix": "tokens"}]}, "train": {**TINY["train"], **train}})
    problems = config.validate(world_size=world_size, check_files=False)
    for says in expected:
        assert sum(says in problem for problem in problems) == 1, (says, problems)
    assert len(problems) == len(expected), problems


@pytest.mark.parametrize("micro_batch, refused", [(1, True), (2, False)])
def test_fp8_with_context_parallelism_needs_each_ranks_tokens_aligned_as_one_processs(micro_batch, refused):
    """16 tokens a micro-batch are float8 products on one process; cut over 2 context ranks, 8 would not be."""
    config = config_from_dict({**TINY, "parallel": {"context": 2}, "precision": {"dtype": "bf16", "fp8": "rowwise"},
                               "data": {"seq_len": 16, "sources": [{"prefix": "tokens"}]},
                               "train": {**TINY["train"], "micro_batch_size": micro_batch}})
    problems = config.validate(world_size=2, check_files=False)
    expected = ("precision.fp8 rowwise with parallel.context 2: each context rank's linear layers see "
                "train.micro_batch_size × data.seq_len / 2 = 8 tokens, not a multiple of 16, so they would compute "
                "in bf16 what one process computes in float8; make micro_batch_size × seq_len (16) divisible by 32")
    assert problems == ([expected] if refused else []), problems


def test_context_parallelism_within_its_rules_is_accepted_and_deepspeed_counts_data_times_context():
    config = config_from_dict({**TINY, "parallel": {"context": 4, "context_method": "all_to_all", "zero_stage": 1},
                               "model": {"preset": "tiny", "num_heads": 8, "num_kv_heads": 4, "hidden_size": 64},
                               "data": {"seq_len": 16, "sources": [{"prefix": "tokens"}]}})
    assert config.validate(world_size=8, check_files=False) == []
    assert (config.data_parallel_size(8), config.shard_replicas(8)) == (2, 8)
    assert deepspeed_config(config, world_size=8)["train_batch_size"] == 8 * 4  # DeepSpeed's ranks: data × context
    assert group_layout_problems(8, 1, 1, 4) == []
