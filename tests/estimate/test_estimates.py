"""Parameter counts, FLOPs and per-rank memory estimates."""

import dataclasses

import pytest

from lnstrain.config.run_config import config_from_dict
from lnstrain.estimate.flops import flops_per_token
from lnstrain.estimate.memory import layer_activation_bytes, memory_estimate
from lnstrain.estimate.report import meta_parameter_count
from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.presets import model_preset


def run_config(model: dict, parallel: dict | None = None, **train) -> "Config":
    return config_from_dict({
        "model": model, "data": {"seq_len": 256, "sources": [{"prefix": "absent/data"}]},
        "parallel": parallel or {}, "train": {"steps": 100, "global_batch_size": 512, "micro_batch_size": 8,
                                              **train}})


def test_7b_preset_has_llama_7b_parameter_count():
    model = model_preset("7b")
    assert model.vocab_size == 32000 and not model.tie_embeddings
    assert model.num_parameters() == 6_738_415_616
    assert model.num_parameters(include_embeddings=False) == 6_738_415_616 - 2 * 32000 * 4096


@pytest.mark.parametrize("scheme", [s.value for s in NormScheme])
@pytest.mark.parametrize("tied", [False, True])
def test_meta_model_count_equals_formula(scheme, tied):
    model = {"preset": "tiny", "norm_scheme": scheme, "tie_embeddings": tied, "vocab_size": 97,
             "norm_type": "layernorm" if scheme == "sandwich_ln" else "rmsnorm"}
    config = run_config(model)
    assert config.model.padded_vocab_size(1) == 104  # the meta model holds the padded vocabulary
    assert meta_parameter_count(config) == config.model.num_parameters(tensor_parallel=1)


def test_flops_per_token_by_hand():
    model = ModelConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                        max_seq_len=16)
    # per layer: q, k, v, o 4·32·32 = 4096; gate, up, down 3·32·64 = 6144; two RMSNorm gains 64 -> 10304
    # non-embedding: 2 · 10304 + final norm 32 = 20640; plus the output head 100 · 32 = 3200 -> N = 23840
    flops = flops_per_token(model, seq_len=16)
    assert flops.matmul_params == 23840
    assert flops.dense == 6 * 23840 == 143040
    assert flops.attention_noncausal == 12 * 2 * 32 * 16 == 12288
    assert flops.noncausal == 155328 and flops.causal == 143040 + 6144


def test_zero_stages_shard_optimizer_then_gradients_then_weights():
    by_stage = {z: memory_estimate(run_config({"preset": "130m"}, {"zero_stage": z}), world_size=8).heaviest
                for z in (0, 1, 2, 3)}
    params = by_stage[0].parameters
    # bf16: moments and the fp32 master copy, divided by the data-parallel size from ZeRO 1 on
    assert by_stage[0].weights == 2 * params and by_stage[0].optimizer == 12 * params
    assert by_stage[1].optimizer == pytest.approx(12 * params / 8)
    # ZeRO 2 (DeepSpeed's ZeRO optimizer): the bf16 .grad, the bucket and an fp32 gradient partition
    assert by_stage[2].optimizer == pytest.approx(12 * params / 8) and by_stage[2].weights == 2 * params
    assert by_stage[3].weights == pytest.approx(2 * params / 8)
    assert by_stage[2].held < by_stage[1].held < by_stage[0].held


def test_fp16_and_fp32_bytes_per_parameter():
    fp16 = run_config({"preset": "60m"}, {"zero_stage": 0})
    fp16 = dataclasses.replace(fp16, precision=dataclasses.replace(fp16.precision, dtype="fp16"))
    stage = memory_estimate(fp16, 8).heaviest
    assert (stage.weights, stage.optimizer) == (2 * stage.parameters, 12 * stage.parameters)
    fp32 = dataclasses.replace(fp16, precision=dataclasses.replace(fp16.precision, dtype="fp32"))
    stage = memory_estimate(fp32, 8).heaviest
    assert (stage.weights, stage.optimizer) == (4 * stage.parameters, 8 * stage.parameters)  # no master copy


def test_tensor_and_pipeline_parallel_divide_the_model():
    model = {"preset": "350m", "tie_embeddings": False}
    single = memory_estimate(run_config(model), 8).heaviest
    tensor2 = memory_estimate(run_config(model, {"tensor": 2}), 8).heaviest
    pipe2 = memory_estimate(run_config(model, {"pipeline": 2}), 8)
    h = 1024
    # tensor parallel halves every matrix; only the 2 norm gains per layer and the final norm are replicated
    replicated = 24 * 2 * h + h
    assert tensor2.parameters == (single.parameters - replicated) // 2 + replicated
    # pipeline: 12 layers per stage; the embedding on stage 0, the head and final norm on stage 1
    embedding = 32000 * h
    assert [st.layers for st in pipe2.stages] == [12, 12]
    layer = (single.parameters - 2 * embedding - h) // 24
    assert pipe2.stages[0].parameters == 12 * layer + embedding
    assert pipe2.stages[1].parameters == 12 * layer + embedding + h
    # 1F1B: the first stage keeps two micro-batches in flight, the last one plus the logits
    per_layer = layer_activation_bytes(model_preset("350m"), 256, 8, 1, False, "none")
    assert pipe2.stages[0].activations["none"] == pytest.approx(2 * 12 * per_layer)


def test_activation_formula_and_checkpointing_modes():
    model = model_preset("130m")
    s, b, h, f, a = 256, 8, 768, 2048, 12
    none = layer_activation_bytes(model, s, b, 1, False, "none")
    assert none == 8 * s * b * h + 2 * s * b * 3 * h + 2 * s * b * h + 6 * s * b * f + 4 * a * s * b
    fp32 = layer_activation_bytes(model, s, b, 1, False, "none", element_bytes=4)
    assert fp32 == 2 * (none - 4 * a * s * b) + 4 * a * s * b  # the fp32 log-sum-exp is fp32 either way
    assert layer_activation_bytes(model, s, b, 1, False, "selective") == none - 4 * a * s * b
    assert layer_activation_bytes(model, s, b, 1, False, "full") == 2 * s * b * h
    stored = layer_activation_bytes(model, s, b, 1, False, "none", scores_stored=True)
    assert stored - none == 5 * a * s * s * b - 4 * a * s * b
    # sequence parallelism also splits the replicated part; without it only the rest is split
    assert layer_activation_bytes(model, s, b, 2, True, "none") == pytest.approx(none / 2)
    assert layer_activation_bytes(model, s, b, 2, False, "none") == pytest.approx(
        8 * s * b * h + (none - 8 * s * b * h) / 2)
    config = run_config({"preset": "130m"}, {"zero_stage": 0}, activation_checkpointing="full")
    estimate = memory_estimate(config, 8)
    assert estimate.total == estimate.total_with("full") < estimate.total_with("none")


def test_deepspeed_buffers_follow_the_optimizer_deepspeed_wraps_ours_in():
    from lnstrain.config.deepspeed_json import zero_bucket_elements
    from lnstrain.config.feasibility import optimizer_kind
    from lnstrain.estimate.parameters import largest_tensor_elements

    def stage(zero: int, deepspeed: dict | None = None, **precision):
        config = run_config({"preset": "130m"}, {"zero_stage": zero})
        config = dataclasses.replace(config, precision=dataclasses.replace(config.precision, **precision),
                                     deepspeed=deepspeed or {})
        return config, memory_estimate(config, 8).heaviest

    config, zero0 = stage(0)
    params = zero0.parameters
    largest = largest_tensor_elements(config.model, 1)
    assert optimizer_kind(config) == "fp16_unfused" and zero0.persistent_buffers == 0
    assert zero0.step == 6 * params  # bf16 .grad and an fp32 copy of each
    config, zero1 = stage(1)
    assert optimizer_kind(config) == "bf16_optimizer" and zero1.persistent_buffers == 4 * params
    config, zero2 = stage(2)
    bucket = zero_bucket_elements(config)
    assert optimizer_kind(config) == "zero" and bucket == -(-params // 2**20) * 2**20  # capped at the model
    # 8 data-parallel ranks: overlap_comm, so two buckets (one reducing while the next fills)
    assert zero2.gradients == pytest.approx(2 * params + 2 * 2 * bucket + 4 * params / 8 + 4 * largest)
    _, smaller = stage(2, {"zero_optimization": {"reduce_bucket_size": 50_000_000}})
    assert smaller.gradients - zero2.gradients == pytest.approx(2 * 2 * (50_000_000 - bucket))
    _, one_bucket = stage(2, {"zero_optimization": {"overlap_comm": False}})
    assert zero2.gradients - one_bucket.gradients == pytest.approx(2 * bucket)
    config, fp32_zero1 = stage(1, dtype="fp32")
    assert optimizer_kind(config) == "zero" and fp32_zero1.optimizer == pytest.approx(12 * params / 8)
    assert fp32_zero1.gradients == pytest.approx(4 * params + 2 * 4 * bucket)  # full .grad + two fp32 buckets
    # ZeRO 1 accumulates the micro-batches (8 here) in its buckets, which then live through the forwards
    assert fp32_zero1.accumulated_gradients == 4 * params + 2 * 4 * bucket and fp32_zero1.backward_buffers == 0
    config, single = stage(1, dtype="fp32", deepspeed=None)
    one_micro_batch = dataclasses.replace(config, train=dataclasses.replace(config.train, global_batch_size=64))
    assert memory_estimate(one_micro_batch, 8).heaviest.backward_buffers == 2 * 4 * bucket  # allocated as backward starts
    config, zero3 = stage(3)
    assert optimizer_kind(config) == "zero3" and zero3.gathered_weights == 2 * params


def test_pipeline_buffers_hold_the_last_stages_logits_between_steps():
    config = run_config({"preset": "130m", "tie_embeddings": False}, {"pipeline": 2})
    first, last = memory_estimate(config, 8).stages
    s, b, h, vocab = 256, 8, 768, config.model.padded_vocab_size(1)
    slots = 2  # DeepSpeed's 1F1B keeps max(2, min(stages - stage, micro-batches)) buffers
    assert first.pipe_buffers == 0  # the first stage receives token ids only
    assert last.pipe_buffers == slots * (2 * s * b * h + 2 * s * b * vocab)
    assert last.held == last.weights + last.optimizer + last.persistent_buffers + last.pipe_buffers
