"""Every family of the depth analysis's table, checked against transformers itself.

For each family a tiny random model (lnstrain/testing/tiny_hf_models.py) is analysed by
`tools/analyze_depth.py --hf`, and:

- ΔP(l) agrees within 1e-5 nats with transformers' own loss (`labels=`) of a model built with layer l
  really deleted: config and state dict without it, later layers renumbered, each keeping its own
  per-layer settings (attention type, dense or MoE);
- the variances agree with transformers' `output_hidden_states`;
- each reported norm gain is the gain the norm module applies, measured through its forward (so
  Gemma's 1 + weight is checked, not assumed);
- the placement the report states is the one transformers' code has: the order in which the norms
  and sublayers run, and what each norm receives.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from lnstrain.analysis.hf_families import FAMILIES as TABLE
from lnstrain.analysis.report import read_analyses
from lnstrain.testing.tiny_hf_models import FAMILIES, NUM_LAYERS, save_tiny_model
from tools.analyze_depth import main as analyze_depth

transformers = pytest.importorskip("transformers")

SEQ_LEN, NUM_SAMPLES = 16, 6
TOLERANCE = 1e-5
PLACEMENT = {"gemma2": "sandwich_ln", "gemma3_text": "sandwich_ln", "gemma3": "sandwich_ln", "olmo2": "output_ln",
             "openai-gpt": "post_ln"}
"""Expected norm scheme by family (pre_ln otherwise), written here independently of the table."""
SUBLAYERS = {"gpt2": ("attn", "mlp"), "openai-gpt": ("attn", "mlp")}
"""(attention, MLP) attribute of a block (self_attn, mlp otherwise)."""
ORDER = {"pre_ln": ["attention_input", "attention", "mlp_input", "mlp"],
         "sandwich_ln": ["attention_input", "attention", "attention_output", "mlp_input", "mlp", "mlp_output"],
         "output_ln": ["attention", "attention_output", "mlp", "mlp_output"],
         "post_ln": ["attention", "attention_residual", "mlp", "mlp_residual"]}


def test_every_family_of_the_table_is_tested_and_documented():
    assert FAMILIES == list(TABLE)
    page = (Path(__file__).resolve().parents[2] / "docs" / "analyze_open_models.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines() if line.startswith("| `")}
    for model_type, family in TABLE.items():
        assert f"| `{family.blocks}` |" in rows[model_type], model_type
        assert rows[model_type].endswith(f"| {family.placement.value} (`{family.placement.norm_scheme}`) |"), model_type
        assert ("| 1 + weight |" in rows[model_type]) == (family.gain_offset == 1.0), model_type


@pytest.fixture(scope="module")
def documents(tiny_corpus) -> list[str]:
    return [json.loads(line)["text"] for line in tiny_corpus.jsonl.read_text().splitlines()]


def reference_windows(directory, documents) -> torch.Tensor:
    """The windows by the rule the tool documents: each document with its special tokens, then EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    stream = []
    for text in documents:
        ids = tokenizer(text)["input_ids"]
        stream += ids + ([tokenizer.eos_token_id] if ids[-1] != tokenizer.eos_token_id else [])
        if len(stream) >= NUM_SAMPLES * (SEQ_LEN + 1):
            break
    return torch.tensor(stream[:NUM_SAMPLES * (SEQ_LEN + 1)]).view(NUM_SAMPLES, SEQ_LEN + 1)


def without_layer(full, family: str, layer: int) -> torch.nn.Module:
    """`full` with block `layer` (1-based) deleted; per-layer settings of the later blocks move with them."""
    config = copy.deepcopy(full.config)
    text = config.get_text_config()
    text.num_hidden_layers -= 1
    index = layer - 1
    if getattr(text, "layer_types", None):
        del text.layer_types[index]
    if getattr(text, "mlp_only_layers", None):
        text.mlp_only_layers = [i - (i > index) for i in text.mlp_only_layers if i != index]
    if getattr(text, "first_k_dense_replace", None) and index < text.first_k_dense_replace:
        text.first_k_dense_replace -= 1
    prefix = re.escape(TABLE[family].blocks)
    state = {}
    for name, tensor in full.state_dict().items():
        match = re.match(rf"({prefix})\.(\d+)\.(.*)", name)
        if match is None:
            state[name] = tensor
        elif int(match.group(2)) != index:
            number = int(match.group(2))
            state[f"{match.group(1)}.{number - (number > index)}.{match.group(3)}"] = tensor
    pruned = transformers.AutoModelForCausalLM.from_config(config)
    pruned.load_state_dict(state, strict=True)
    return pruned.eval()


@torch.no_grad()
def loss_of(model, windows: torch.Tensor) -> float:
    return float(model(input_ids=windows, labels=windows, use_cache=False).loss)


@torch.no_grad()
def applied_gain(norm: torch.nn.Module, width: int) -> float:
    """Mean |gain| the norm applies: its outputs for x and -x, x = (1, -1, 1, ...) (mean 0, RMS 1)."""
    x = torch.tensor([1.0, -1.0] * (width // 2)).view(1, 1, width)
    return float(((norm(x) - norm(-x)) / (2 * x)).abs().mean())


def placement_trace(full, family: str, windows: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what ran, its input, its output) for the norms and sublayers of the first block, in order."""
    block = TABLE[family].block_list(full)[0]
    attention, mlp = SUBLAYERS.get(family, ("self_attn", "mlp"))
    trace = []

    def record(label):
        def hook(_module, args, kwargs, output):
            given = args[0] if args else kwargs["hidden_states"]
            trace.append((label, given, output[0] if isinstance(output, (tuple, list)) else output))
        return hook

    named = [(role, getattr(block, attribute)) for role, attribute in TABLE[family].norms]
    named += [("attention", getattr(block, attention)), ("mlp", getattr(block, mlp)), ("block", block)]
    handles = [module.register_forward_hook(record(label), with_kwargs=True) for label, module in named]
    with torch.no_grad():
        full(input_ids=windows[:, :-1], use_cache=False)
    for handle in handles:
        handle.remove()
    return trace


def check_placement(trace, scheme: str) -> None:
    block_input = trace[-1][1]
    steps = {label: (given, output) for label, given, output in trace[:-1]}
    assert [label for label, _, _ in trace[:-1]] == ORDER[scheme]
    if "attention_input" in steps:
        torch.testing.assert_close(steps["attention_input"][0], block_input)
    for sublayer in ("attention", "mlp"):
        if f"{sublayer}_output" in steps:
            torch.testing.assert_close(steps[f"{sublayer}_output"][0], steps[sublayer][1])
    if "attention_residual" in steps:
        torch.testing.assert_close(steps["attention_residual"][0], block_input + steps["attention"][1])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_matches_transformers_with_a_layer_deleted(family, documents, tiny_corpus, tmp_path):
    directory = save_tiny_model(tmp_path / family, family, documents[:100], seed=FAMILIES.index(family))
    assert analyze_depth(["--hf", str(directory), "--text", str(tiny_corpus.jsonl), "--seq-len", str(SEQ_LEN),
                          "--num-samples", str(NUM_SAMPLES), "--batch-size", "4", "--output", str(tmp_path / "out"),
                          "--no-plots"]) == 0
    run = read_analyses(tmp_path / "out")[0]
    scheme = PLACEMENT.get(family, "pre_ln")
    assert run.norm_scheme == scheme and run.source == f"Hugging Face {family}, fp32"
    assert run.num_layers == NUM_LAYERS and run.validation_tokens == NUM_SAMPLES * SEQ_LEN
    assert run.windows.seq_len == SEQ_LEN and run.windows.count == NUM_SAMPLES

    windows = reference_windows(directory, documents)
    full = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    full_loss = loss_of(full, windows)
    assert abs(run.baseline.loss - full_loss) <= TOLERANCE
    deltas = [loss_of(without_layer(full, family, layer), windows) - full_loss for layer in range(1, NUM_LAYERS + 1)]
    assert max(abs(d) for d in deltas) > 1e-3  # the layers matter, so a wrong layer would show
    for pruned, expected in zip(run.pruning, deltas, strict=True):
        assert abs(pruned.delta_loss - expected) <= TOLERANCE, (pruned.layer, pruned.delta_loss, expected)

    with torch.no_grad():
        hidden = full(input_ids=windows[:, :-1], output_hidden_states=True, use_cache=False).hidden_states
    for index in range(NUM_LAYERS):  # transformers' last entry has the final norm applied; the tool's does not
        assert run.output_variance[index] == pytest.approx(float(hidden[index].double().var(unbiased=False)), rel=1e-5)

    width = full.config.get_text_config().hidden_size
    blocks = TABLE[family].block_list(full)
    assert run.norm_names == [role for role, _ in TABLE[family].norms]
    applied = [applied_gain(getattr(block, attribute), width) for block in blocks for _, attribute in TABLE[family].norms]
    assert [gain for layer in run.norm_gains for gain in layer] == pytest.approx(applied, rel=1e-5)
    check_placement(placement_trace(full, family, windows), scheme)
