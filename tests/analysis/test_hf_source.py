"""tools/analyze_depth.py --hf on Hugging Face models, each family checked against transformers itself.

The reference for ΔP(l) deletes layer l for real: a model of L - 1 layers is built from the config
and the state dict without layer l (later layers renumbered, Qwen2's per-layer attention types
kept with their layers), and its loss is transformers' own (`labels=`). The reference windows are
tokenized here, by the rule the tool documents: each document as the tokenizer encodes it with its
special tokens, then EOS, back to back.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from lnstrain.analysis.report import read_analyses
from tests.analysis.hf_models import EOS, NUM_LAYERS, save_tiny_model
from tools.analyze_depth import main as analyze_depth

transformers = pytest.importorskip("transformers")

SEQ_LEN, NUM_SAMPLES = 16, 6
TOLERANCE = 1e-5
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def corpus_documents(corpus) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.jsonl.read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_dirs(tiny_corpus, tmp_path_factory):
    """One saved tiny model per family (built on first use)."""
    built = {}

    def get(family: str):
        if family not in built:
            if family == "qwen3" and not hasattr(transformers, "Qwen3Config"):
                pytest.skip("this transformers has no Qwen3")
            directory = tmp_path_factory.mktemp(family)
            built[family] = save_tiny_model(directory, family, corpus_documents(tiny_corpus)[:100],
                                            seed=FAMILIES.index(family))
        return built[family]
    return get


def reference_windows(directory, corpus) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    stream = []
    for text in corpus_documents(corpus):
        ids = tokenizer(text)["input_ids"]
        stream += ids + ([tokenizer.eos_token_id] if ids[-1] != tokenizer.eos_token_id else [])
    count = SEQ_LEN + 1
    return torch.tensor(stream[:NUM_SAMPLES * count]).view(NUM_SAMPLES, count)


def without_layer(directory, layer: int) -> torch.nn.Module:
    """The model of `directory` with decoder layer `layer` (1-based) deleted."""
    full = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    config = full.config.to_dict()
    config["num_hidden_layers"] -= 1
    if config.get("layer_types"):
        del config["layer_types"][layer - 1]
    state = {}
    for name, tensor in full.state_dict().items():
        match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if match is None:
            state[name] = tensor
        elif int(match.group(1)) != layer - 1:
            index = int(match.group(1))
            state[f"model.layers.{index - (index > layer - 1)}.{match.group(2)}"] = tensor
    pruned = transformers.AutoModelForCausalLM.from_config(type(full.config).from_dict(config))
    pruned.load_state_dict(state, strict=True)
    return pruned.eval()


@torch.no_grad()
def transformers_loss(model, windows: torch.Tensor) -> float:
    return float(model(input_ids=windows, labels=windows).loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_matches_transformers_with_the_layer_deleted(family, hf_dirs, tiny_corpus, tmp_path, caplog):
    directory = hf_dirs(family)
    with caplog.at_level(logging.INFO, logger="lnstrain.analysis.progress"):
        assert analyze_depth(["--hf", str(directory), "--text", str(tiny_corpus.jsonl), "--seq-len", str(SEQ_LEN),
                              "--num-samples", str(NUM_SAMPLES), "--batch-size", "4", "--output", str(tmp_path),
                              "--no-plots"]) == 0
    run = read_analyses(tmp_path)[0]
    assert run.num_layers == NUM_LAYERS and run.norm_scheme == "pre_ln" and run.source == f"Hugging Face {family}, fp32"
    assert run.validation_tokens == NUM_SAMPLES * SEQ_LEN

    windows = reference_windows(directory, tiny_corpus)
    full = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    full_loss = transformers_loss(full, windows)
    assert abs(run.baseline.loss - full_loss) <= TOLERANCE
    deltas = [transformers_loss(without_layer(directory, layer), windows) - full_loss
              for layer in range(1, NUM_LAYERS + 1)]
    assert max(abs(d) for d in deltas) > 1e-3  # the layers matter, so a wrong layer would show
    for pruned, expected in zip(run.pruning, deltas):
        assert abs(pruned.delta_loss - expected) <= TOLERANCE, (pruned.layer, pruned.delta_loss, expected)

    with torch.no_grad():
        hidden = full(input_ids=windows[:, :-1], output_hidden_states=True).hidden_states
    for index in range(NUM_LAYERS):  # transformers' last entry has the final norm applied; the tool's does not
        assert run.output_variance[index] == pytest.approx(float(hidden[index].double().var(unbiased=False)), rel=1e-5)
    gains = [float(getattr(block, norm).weight.detach().abs().mean()) for block in full.model.layers
             for norm in ("input_layernorm", "post_attention_layernorm")]
    assert [gain for layer in run.norm_gains for gain in layer] == pytest.approx(gains, rel=1e-6)
    progress = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert len(progress) == NUM_LAYERS + 2 and progress[-1].startswith(f"{directory.name}: pass {NUM_LAYERS + 2}/")


def test_documents_questions_and_answers_use_the_models_tokenizer(hf_dirs):
    from lnstrain.analysis.hf_source import load_hf_tokenizer

    for family, bos in (("llama", True), ("qwen2", False)):
        tokenizer = load_hf_tokenizer(hf_dirs(family))
        hf = tokenizer.tokenizer
        eos = hf.convert_tokens_to_ids(EOS)
        document = tokenizer.document("The model reads the signal.")
        assert document[-1] == eos and (document[0] == hf.bos_token_id) == bos
        assert tokenizer.question_prefix() == ([hf.bos_token_id] if bos else [eos])
        answer = tokenizer.continuation("A layer scales", "the loss")
        assert hf.decode(answer) == " the loss"
        assert tokenizer.encode("A layer scales") + answer == tokenizer.encode("A layer scales the loss")


def test_multiple_choice_with_the_models_tokenizer(hf_dirs, tiny_corpus, tmp_path):
    questions = [{"question": "The model reads", "choices": ["the signal.", "its variance again."], "answer": 0},
                 {"question": "A layer scales", "choices": ["one value", "the loss", "every step"], "answer": "B"}]
    (tmp_path / "task.jsonl").write_text("\n".join(json.dumps(q) for q in questions))
    assert analyze_depth(["--hf", str(hf_dirs("qwen2")), "--text", str(tiny_corpus.jsonl), "--seq-len", "16",
                          "--num-samples", "2", "--mc-task", str(tmp_path / "task.jsonl"),
                          "--output", str(tmp_path / "out"), "--no-plots"]) == 0
    run = read_analyses(tmp_path / "out")[0]
    assert run.baseline.accuracy in (0.0, 0.5, 1.0)
    assert all(p.delta_accuracy == p.result.accuracy - run.baseline.accuracy for p in run.pruning)


@pytest.mark.parametrize("dtype, tolerance", [("bf16", 0.05), ("fp16", 0.01)])
def test_half_precision_loads_half_weights_and_stays_close(dtype, tolerance, hf_dirs, tiny_corpus):
    from lnstrain.analysis.eval_data import text_batches
    from lnstrain.analysis.hf_source import DTYPES, load_hf_model
    from lnstrain.analysis.pruning import evaluate

    directory = hf_dirs("llama")
    full, half = load_hf_model(directory), load_hf_model(directory, dtype=dtype)
    assert {p.dtype for p in half.module.parameters()} == {DTYPES[dtype]}
    batches = text_batches(str(tiny_corpus.jsonl), full.tokenizer.document, SEQ_LEN, NUM_SAMPLES, 4)
    full_loss, half_loss = evaluate(full, batches).loss, evaluate(half, batches).loss
    assert full_loss != half_loss and abs(full_loss - half_loss) < tolerance


def test_a_device_map_that_offloads_layers_gives_the_same_figures(hf_dirs, tiny_corpus, tmp_path):
    """Layers 2-3 offloaded to disk: accelerate's hooks load them for each forward, and hold their norm weights."""
    pytest.importorskip("accelerate")
    from lnstrain.analysis.depth_analysis import analyze_model
    from lnstrain.analysis.eval_data import text_batches
    from lnstrain.analysis.hf_source import load_hf_model

    directory = hf_dirs("qwen2")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu",
                  "lm_head": "cpu"}
    placed = load_hf_model(directory, device_map=device_map, offload_folder=str(tmp_path))
    assert placed.layers()[1].input_layernorm.weight.is_meta
    plain = load_hf_model(directory)
    batches = text_batches(str(tiny_corpus.jsonl), plain.tokenizer.document, SEQ_LEN, 2, 2)
    placed_run, plain_run = analyze_model(placed, batches), analyze_model(plain, batches)
    assert placed_run.output_variance == pytest.approx(plain_run.output_variance, rel=1e-6)
    placed_deltas, plain_deltas = ([p.delta_loss for p in run.pruning] for run in (placed_run, plain_run))
    assert placed_deltas == pytest.approx(plain_deltas, abs=1e-6)
    assert placed_run.norm_gains == plain_run.norm_gains


def test_unsupported_architectures_and_missing_pieces_are_refused(hf_dirs, tiny_corpus, tmp_path, capsys, monkeypatch):
    def refused(*argv: str) -> str:
        capsys.readouterr()
        assert analyze_depth([*argv, "--output", str(tmp_path / "out"), "--no-plots"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    for argv in (["--hf", str(tmp_path / "gpt2")], ["--compare", str(tmp_path / "gpt2"), str(hf_dirs("llama"))]):
        err = refused(*argv, "--text", str(tiny_corpus.jsonl))
        assert "model_type 'gpt2' is not supported" in err
        assert "LLaMA (model_type 'llama'), Mistral (model_type 'mistral'), Qwen2 (model_type 'qwen2')" in err
    assert "no config.json" in refused("--hf", str(tmp_path), "--text", str(tiny_corpus.jsonl))

    llama = str(hf_dirs("llama"))
    err = refused("--hf", llama, "--data", str(tiny_corpus.prefix), "--data-tokenizer", str(tiny_corpus.tokenizer))
    assert "whose vocabulary is not the model's" in err and "--text FILE.jsonl" in err
    assert "pass --data-tokenizer" in refused("--hf", llama, "--data", str(tiny_corpus.prefix))
    assert "longer than" in refused("--hf", llama, "--text", str(tiny_corpus.jsonl), "--seq-len", "100")

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    assert "pip install 'lnstrain[hf]'" in refused("--hf", llama, "--text", str(tiny_corpus.jsonl))
