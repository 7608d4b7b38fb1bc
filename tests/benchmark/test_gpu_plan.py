"""The GPU check's plan fits the device budget: each call's seconds add up to at most the call limit,
the first call holds the issue's decisive items in their order, and --plan prints what the plan says."""

from __future__ import annotations

from lnstrain.benchmark.gpu_plan import CALL_LIMIT_S, CALLS, ITEMS, PLAN, call_items, call_total, plan_text
from lnstrain.benchmark.gpu_summary import summary_rows
from lnstrain.benchmark.switches import SWITCHES, parse_switch_sets
from tests.tool_scripts import load_tool

DEVICE_COMMAND_LIMIT_S = 600
"""The device tool's limit on one command; a call must end inside it with room for the copy back."""


def test_every_call_fits_the_limit_and_the_limit_fits_one_device_command():
    assert CALL_LIMIT_S <= 540 < DEVICE_COMMAND_LIMIT_S
    for call in CALLS:
        assert 0 < call_total(call) <= CALL_LIMIT_S, (call, call_total(call))
        assert all(item.seconds > 0 for item in call_items(call))


def test_the_first_call_runs_the_decisive_items_first_in_the_issues_order():
    first = [item.name for item in call_items(1)]
    assert first == ["environment", "1b_eager", "core_tests", "1b_compiled", "1b_fp8_compiled"]
    assert [ITEMS[name].issue_item for name in first] == ["(a)", "(b) (c) (e)", "(d)", "(b)", "(g)"]
    # the core tests need all their seconds: they fit even when the two items before them overrun
    # (the environment took 56 s of its 50 on 2026-11-28), and the last item starts with 85 % of its own
    before_core = ITEMS["environment"].seconds + ITEMS["1b_eager"].seconds
    assert before_core + 15 + ITEMS["core_tests"].seconds <= CALL_LIMIT_S
    assert call_total(1) - ITEMS["1b_fp8_compiled"].seconds + 15 + ITEMS["1b_fp8_compiled"].least_seconds <= CALL_LIMIT_S
    assert ITEMS["core_tests"].seconds >= 110  # 100 s for the 7 core tests of 2026-11-26
    assert ITEMS["environment"].seconds <= 60  # fail fast
    assert ITEMS["core_tests"].seconds <= 120 and ITEMS["core_tests"].args[:2] == ("-m", "gpu and gpu_core")
    eager, compiled = ITEMS["1b_eager"].args, ITEMS["1b_compiled"].args
    assert "train.compile=false" in eager and "train.compile=true" in compiled
    # both profile a step before anything is timed, and leave each change out in turn on their one engine
    for args in (eager, compiled):
        assert args[args.index("--profile-steps") + 1] == "1" and "--switches" in args
    assert set(parse_switch_sets(eager[eager.index("--switches") + 1])) == {
        ("lns_factor",), ("rotary_kernel",), ("swiglu_kernel",), ("fused_accumulation",)}
    compiled_sets = parse_switch_sets(compiled[compiled.index("--switches") + 1])
    assert ("chunked_loss",) in compiled_sets and ("fused_accumulation",) in compiled_sets
    # leaving the kernels out recompiles every layer: its own item, in call 2, against inductor's fusion
    assert not any("rotary_kernel" in off for off in compiled_sets)
    kernels_off = ITEMS["1b_compiled_kernels_off"]
    assert kernels_off.call == 2 and ("rotary_kernel", "swiglu_kernel") in parse_switch_sets(
        kernels_off.args[kernels_off.args.index("--switches") + 1])
    fp8 = ITEMS["1b_fp8_compiled"].args
    assert "precision.fp8=tensorwise" in fp8 and "train.compile=true" in fp8 and "--switches" not in fp8
    second = [item.name for item in call_items(2)]  # item 5's layout and the ratio already met lead the second call
    assert second[:3] == ["1b_compiled_kernels_off", "1b_micro_batch_8", "1b_vs_hf_model"]
    assert "1b_lns_vs_pre_ln" in second
    assert "train.micro_batch_size=8" in ITEMS["1b_micro_batch_8"].args
    assert ITEMS["1b_vs_hf_model"].seconds < 55  # met in the first call: shortened
    assert {"full_tests", "7b_width_2_layers", "7b_width_4_layers"} <= {item.name for item in PLAN if item.call > 1}


def test_the_1b_benchmark_config_is_the_training_layout():
    from lnstrain.config.feasibility import OptimizerKind, optimizer_kind
    from lnstrain.config.run_config import load_config
    from lnstrain.benchmark.gpu_plan import CONFIG_1B

    config = load_config(CONFIG_1B, [], 1, validate=False)
    assert config.parallel.zero_stage == 1 and config.precision.dtype == "bf16" and config.precision.fp32_grad_accum
    assert optimizer_kind(config) is OptimizerKind.BF16_OPTIMIZER  # fp32 master weights, fp32 accumulation
    assert config.grad_accumulation_steps(1) >= 8 and config.data.seq_len == 2048
    assert config.model.ffn_hidden_size % 256 == 0 and config.model.norm_scheme.value == "lns"


def test_plan_prints_every_item_and_ends_with_the_total(capsys):
    assert load_tool("gpu_check").main(["--plan"]) == 0
    text = capsys.readouterr().out
    assert text == plan_text(1) + "\n"
    lines = text.strip().splitlines()
    assert lines[-1] == f"total {call_total(1)} s of {CALL_LIMIT_S} s"
    assert all(any(line.split()[0] == item.name for line in lines[1:-1]) for item in call_items(1))


def test_an_empty_document_lists_every_first_call_figure_as_not_run():
    rows = summary_rows({"items": {}})
    assert {row.source for row in rows} >= {"environment", "1b_eager", "1b_compiled", "1b_fp8_compiled", "core_tests",
                                            "1b_vs_hf_model"}
    assert all(row.status == "not measured" for row in rows)


def test_every_switch_the_plan_names_exists():
    for item in PLAN:
        if "--switches" in item.args:
            names = {name for off in parse_switch_sets(item.args[item.args.index("--switches") + 1]) for name in off}
            assert names <= set(SWITCHES), item.name
