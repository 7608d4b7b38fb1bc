"""tools/analyze_depth.py --hf: tokenizers, precision, placement over devices, and every refusal, all
found before any weight is read. Each family against transformers: test_hf_families.py."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from lnstrain.analysis.report import read_analyses
from lnstrain.testing.tiny_hf_models import EOS, FAMILIES, save_tiny_model
from tools.analyze_depth import main as analyze_depth

transformers = pytest.importorskip("transformers")

SEQ_LEN, NUM_SAMPLES = 16, 6


def corpus_documents(corpus) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.jsonl.read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_dirs(tiny_corpus, tmp_path_factory):
    """One saved tiny model per family (built on first use)."""
    built = {}

    def get(family: str):
        if family not in built:
            directory = tmp_path_factory.mktemp(family)
            built[family] = save_tiny_model(directory, family, corpus_documents(tiny_corpus)[:100],
                                            seed=FAMILIES.index(family))
        return built[family]
    return get


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
    from lnstrain.analysis.eval_data import text_windows
    from lnstrain.analysis.hf_source import DTYPES, load_hf_model
    from lnstrain.analysis.pruning import evaluate

    directory = hf_dirs("llama")
    full, half = load_hf_model(directory), load_hf_model(directory, dtype=dtype)
    assert {p.dtype for p in half.module.parameters()} == {DTYPES[dtype]}
    batches = text_windows(str(tiny_corpus.jsonl), full.tokenizer, SEQ_LEN, NUM_SAMPLES, 4).batches
    full_loss, half_loss = evaluate(full, batches).loss, evaluate(half, batches).loss
    assert full_loss != half_loss and abs(full_loss - half_loss) < tolerance


def test_a_device_map_that_offloads_layers_gives_the_same_figures(hf_dirs, tiny_corpus, tmp_path):
    """Layers 2-3 offloaded to disk: accelerate's hooks load them for each forward, and hold their norm weights."""
    pytest.importorskip("accelerate")
    from lnstrain.analysis.depth_analysis import analyze_model
    from lnstrain.analysis.eval_data import text_windows
    from lnstrain.analysis.hf_source import load_hf_model

    directory = hf_dirs("qwen2")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu",
                  "lm_head": "cpu"}
    placed = load_hf_model(directory, device_map=device_map, offload_folder=str(tmp_path))
    assert placed.layers()[1].input_layernorm.weight.is_meta
    plain = load_hf_model(directory)
    batches = text_windows(str(tiny_corpus.jsonl), plain.tokenizer, SEQ_LEN, 2, 2).batches
    placed_run, plain_run = analyze_model(placed, batches), analyze_model(plain, batches)
    assert placed_run.output_variance == pytest.approx(plain_run.output_variance, rel=1e-6)
    placed_deltas, plain_deltas = ([p.delta_loss for p in run.pruning] for run in (placed_run, plain_run))
    assert placed_deltas == pytest.approx(plain_deltas, abs=1e-6)
    assert placed_run.norm_gains == plain_run.norm_gains


def refusal(capsys, tmp_path, *argv: str) -> str:
    """stderr of a run that must be refused: exit 2, no traceback, nothing written."""
    capsys.readouterr()
    assert analyze_depth([*argv, "--output", str(tmp_path / "out"), "--no-plots"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not (tmp_path / "out").exists()
    assert " layers (" not in captured.out  # no model was analysed
    return captured.err


def model_without_weights(tmp_path, name: str, source, *, tokenizer: bool = True, model_type: str | None = None):
    """A copy of `source` whose weights file cannot be read (a pytorch_model.bin of garbage: nothing reads
    such a file before the weights load): a refusal that mentions anything else was made before the weights
    were read."""
    directory = tmp_path / name
    shutil.copytree(source, directory)
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not a torch file")
    if not tokenizer:
        for file in directory.glob("tokenizer*"):
            file.unlink()
    if model_type is not None:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return directory


def test_refusals_come_before_the_weights(hf_dirs, tiny_corpus, tmp_path, capsys, monkeypatch):
    text = ["--text", str(tiny_corpus.jsonl)]
    falcon = model_without_weights(tmp_path, "falcon", hf_dirs("llama"), model_type="falcon")
    err = refusal(capsys, tmp_path, "--hf", str(falcon), *text)
    assert "model_type 'falcon' is not supported" in err
    assert "LLaMA ('llama', pre_ln)" in err and "Gemma 2 ('gemma2', sandwich_ln)" in err and "OLMo 2 ('olmo2', output_ln)" in err
    bare = model_without_weights(tmp_path, "bare", hf_dirs("llama"), tokenizer=False)
    err = refusal(capsys, tmp_path, "--hf", str(bare), *text)
    assert f"--text needs the model's own tokenizer, but {bare} has no tokenizer" in err and "sentencepiece" not in err
    assert "no config.json" in refusal(capsys, tmp_path, "--hf", str(tmp_path), *text)

    llama = str(hf_dirs("llama"))
    err = refusal(capsys, tmp_path, "--hf", llama, "--data", str(tiny_corpus.prefix), "--data-tokenizer",
                  str(tiny_corpus.tokenizer))
    assert "whose vocabulary is not the model's" in err and "--text FILE.jsonl" in err
    assert "pass --data-tokenizer" in refusal(capsys, tmp_path, "--hf", llama, "--data", str(tiny_corpus.prefix))
    assert "--seq-len 100 is longer than" in refusal(capsys, tmp_path, "--hf", llama, *text, "--seq-len", "100")

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    assert "pip install 'lnstrain[hf]'" in refusal(capsys, tmp_path, "--hf", llama, *text)


def broken_copy(tmp_path, name: str, source, change) -> str:
    """A copy of `source` whose model.safetensors ``change`` rewrites (the state dict, in place)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / name
    shutil.copytree(source, directory)
    weights = load_file(directory / "model.safetensors")
    change(weights)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return str(directory)


def test_broken_weights_are_one_line_and_exit_2_and_no_layer_is_analysed_fresh(hf_dirs, tiny_corpus, tmp_path,
                                                                                 capsys):
    import torch

    text = ["--text", str(tiny_corpus.jsonl)]
    garbage = tmp_path / "garbage"
    shutil.copytree(hf_dirs("llama"), garbage)
    (garbage / "model.safetensors").write_bytes(b"garbage")
    [line] = refusal(capsys, tmp_path, "--hf", str(garbage), *text).splitlines()  # before any weight is read
    assert line == (f"analyze_depth: nothing analysed: {garbage / 'model.safetensors'}: not a readable safetensors file "
                    "(Error while deserializing header: header too small); download or save the weights again")

    def reshape(weights):
        weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 5)

    reshaped = broken_copy(tmp_path, "reshaped", hf_dirs("llama"), reshape)
    [line] = refusal(capsys, tmp_path, "--hf", reshaped, *text).splitlines()
    assert line.startswith(f"analyze_depth: {reshaped}: weights of another shape than config.json gives: "
                           "model.layers.1.mlp.up_proj.weight is [3, 5] in the files, [64, 32] in the model;"), line

    def drop_layer_2(weights):
        for name in [name for name in weights if ".layers.2." in name]:
            del weights[name]

    holed = broken_copy(tmp_path, "holed", hf_dirs("llama"), drop_layer_2)
    [line] = refusal(capsys, tmp_path, "--hf", holed, *text).splitlines()
    assert line.startswith(f"analyze_depth: {holed}: weights missing from the files: model.layers.2.* (9 tensors); "
                           "transformers would start them from random values"), line


def test_compare_checks_every_entry_first_and_lists_every_problem(hf_dirs, tiny_corpus, tmp_path, capsys):
    llama = hf_dirs("llama")
    falcon = model_without_weights(tmp_path, "falcon", llama, model_type="falcon")
    bare = model_without_weights(tmp_path, "bare", llama, tokenizer=False)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    namesake = tmp_path / "elsewhere" / llama.name
    shutil.copytree(llama, namesake)
    err = refusal(capsys, tmp_path, "--compare", str(llama), str(falcon), str(bare), str(tmp_path / "notes"),
                  str(namesake), str(tmp_path / "missing"), "--text", str(tiny_corpus.jsonl), "--seq-len", "16")
    assert "5 problems, nothing analysed" in err
    assert f"{falcon}: model_type 'falcon' is not supported" in err
    assert f"{bare}: --text needs the model's own tokenizer" in err
    assert f"{tmp_path / 'notes'} is none of what --compare takes: not a finished analysis" in err
    assert f"several runs are named {llama.name} ({llama}, {namesake})" in err
    assert f"{tmp_path / 'missing'} does not exist" in err
    assert "the runs were not measured" not in err  # windows are compared once every entry is sound


def test_models_with_different_tokenizers_are_measured_on_different_windows(hf_dirs, tmp_path, capsys, caplog):
    """LLaMA's tokenizer puts BOS first, Qwen2's does not: the same text gives different windows."""
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                  ["The model reads the signal.", "A layer scales the loss."] * 4))
    models = [str(hf_dirs("llama")), str(hf_dirs("qwen2"))]
    argv = ["--compare", *models, "--text", str(tmp_path / "short.jsonl"), "--seq-len", "8", "--num-samples", "100"]
    err = refusal(capsys, tmp_path, *argv)
    assert "token-id checksum differs" in err and "tokenizer checksum differs" in err and "source checksum" not in err
    with caplog.at_level(logging.WARNING):
        assert analyze_depth([*argv, "--allow-different-windows", "--output", str(tmp_path / "out"), "--no-plots"]) == 0
    llama, qwen2 = read_analyses(tmp_path / "out")
    assert llama.windows.requested == 100 and llama.windows.count < 100
    assert f"holds only {llama.windows.count} windows of 9 tokens; 100 were asked for" in caplog.text
    assert llama.windows.source_sha256 == qwen2.windows.source_sha256
    assert llama.windows.tokenizer_sha256 != qwen2.windows.tokenizer_sha256
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"{llama.windows.count} windows (of 100 asked) of 8 + 1 tokens" in report
    assert "**The runs were not measured on the same windows**" in report
    assert "Each run is its own configuration" in report and f"{llama.name} (pre_ln) > 1" in report
