"""A study's variants axis and its depth collection (claims against training length), without training:
the checkpoints' analyses are synthetic (tests/analysis/test_claims.py), everything after is real."""

import csv
import shutil
from pathlib import Path

import pytest
import yaml

from lnstrain.config.loader import ConfigError
from lnstrain.evaluation.results import write_results
from lnstrain.run_files import FINAL_METRICS_FILE, downstream_file
from lnstrain.study.collect import collect_results
from lnstrain.study import depth as study_depth
from lnstrain.study.depth import analysis_steps, collect_depth, turning_step
from lnstrain.study.plan import plan_study
from lnstrain.study.runs import study_runs
from lnstrain.study.spec import DepthCollection, load_study
from lnstrain.testing.tiny_corpus import build_tiny_corpus
from tests.analysis.test_claims import synthetic

REPO = Path(__file__).resolve().parents[2]


def test_variants_are_an_axis_with_their_own_overrides():
    study = load_study(REPO / "configs/studies/depth_turn.yaml")
    runs = study_runs(study)
    assert [r.name for r in runs[:7]] == [  # seed by seed: a study cut short holds whole comparisons
        "depth16x64_pre_ln_lr3e-3_s1234", "depth16x64_lns_lr3e-3_s1234", "depth16x64_lns_gain_init_lr3e-3_s1234",
        "depth16x64_pre_ln_lr3e-3_s1235", "depth16x64_lns_lr3e-3_s1235", "depth16x64_lns_gain_init_lr3e-3_s1235",
        "depth16x64_pre_ln_lr3e-3-300steps_s1234"]
    by_name = {r.name: r.config for r in runs}
    assert by_name["depth16x64_lns_lr1e-3_s1234"].optim.lr == 1e-3
    assert by_name["depth16x64_lns_lr1e-3_s1234"].train.steps == 7200
    short = by_name["depth16x64_lns_gain_init_lr3e-3-1200steps_s1234"]
    assert (short.train.steps, short.optim.lr, short.model.norm_scheme.value) == (1200, 3e-3, "lns_gain_init")
    assert short.run.dir == Path("depth_study/runs/depth16x64_lns_gain_init_lr3e-3-1200steps_s1234")
    assert len(runs) == 24 and all(p.error == "" for p in plan_study(study))


def test_variant_names_and_depth_reference_are_checked(tmp_path):
    study = yaml.safe_load((REPO / "configs/studies/depth_turn.yaml").read_text())
    study.update(recipe=str(REPO / "configs/recipes/depth_cpu.yaml"), sizes_dir=str(REPO / "configs/sizes"),
                 schemes_dir=str(REPO / "configs/schemes"), variants={"lr 1e-3": ["optim.lr=1e-3"]},
                 depth={"data": "x", "reference": "post_ln", "steps": [0]})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(ConfigError) as error:
        load_study(tmp_path / "study.yaml")
    text = str(error.value)
    assert "variants: name 'lr 1e-3'" in text and "depth.reference: 'post_ln' is not one of" in text
    assert "depth.steps must be positive" in text


@pytest.mark.parametrize("verdicts, turn", [
    ([(1, False), (2, True), (3, True)], 2),
    ([(1, True), (2, False), (3, True)], 3),
    ([(1, True), (2, True), (3, False)], None),
    ([(1, None), (2, True)], 2),
    ([(1, True), (2, True), (3, None)], 1),  # not analysed at the last length yet: skipped
    ([(1, False), (2, None)], None),
    ([], None),
])
def test_turning_step(verdicts, turn):
    assert turning_step(verdicts) == turn


def test_analysis_steps():
    assert analysis_steps(DepthCollection(data="x", steps=[600, 300, 7200]), 1200) == [300, 600]
    assert analysis_steps(DepthCollection(data="x"), 1200) == [1200]


def test_collect_depth_compares_schemes_per_variant_and_length(tmp_path, monkeypatch):
    """LNS's deep layers matter less than Pre-LN's at 300 steps and more from 600 on (synthetic)."""
    study = load_study(REPO / "configs/studies/depth_turn.yaml")
    study.spec.output_dir = str(tmp_path)
    study.spec.depth.archive = ""  # the study's data is not built here: test_depth_archive builds some
    study.spec.variants = {"lr3e-3": ["optim.lr=3e-3", "train.steps=600"]}
    study.spec.seeds = [1234]
    deep = {("pre_ln", 300): 0.05, ("pre_ln", 600): 0.05, ("lns", 300): 0.01, ("lns", 600): 0.08,
            ("lns_gain_init", 300): 0.06, ("lns_gain_init", 600): 0.09}

    def fake_analysis(step_dir, depth, name, trust):
        scheme = name.rsplit("_s", 1)[0]
        value = deep[(scheme, int(step_dir.name.removeprefix("global_step")))]
        analysis = synthetic(name, scheme, delta=(1.0, 0.5, value, value), loss=4.0 + value)
        if scheme == "lns":  # effective gains of layers 1-4 (attention, MLP)
            analysis.norm_gains = [[1.0, 1.0], [0.7, 0.7], [0.5, 0.3], [0.2, 0.2]]
        return analysis

    monkeypatch.setattr(study_depth, "analyse_checkpoint", fake_analysis)
    monkeypatch.setattr("lnstrain.checkpoint.metadata.is_complete", lambda step_dir: True)
    planned = plan_study(study)
    for p in planned:
        for step in (300, 600):
            (p.config.run.dir / "checkpoints" / f"global_step{step}").mkdir(parents=True)
    accuracy = {("pre_ln", 600): 0.25, ("lns", 300): 0.5, ("lns", 600): 0.75}  # lm-eval ran on these only
    for p in planned:
        for (scheme, step), value in accuracy.items():
            if p.run.scheme == scheme:
                write_results({"metrics": {"hellaswag": {"acc": value / 2, "acc_norm": value}}},
                              downstream_file(p.config.run.dir, step))
    files = collect_depth(study, planned)
    with open(files["claims"]) as handle:
        rows = [r for r in csv.DictReader(handle) if r["claim"] == "lns_deep_layers_matter_more"]
    assert {(r["scheme"], r["step"], r["tokens"], r["holds"]) for r in rows} == {
        ("lns", "300", "307200", "False"), ("lns", "600", "614400", "True"),
        ("lns_gain_init", "300", "307200", "True"), ("lns_gain_init", "600", "614400", "True")}
    report = files["depth report"].read_text()
    assert "| `lns_deep_layers_matter_more` | lns | ✗ | ✓ | 614K |" in report
    assert "| `lns_deep_layers_matter_more` | lns_gain_init | ✓ | ✓ | 307K |" in report
    section = report.split("### depth16x64_lr3e-3")[1]
    deep_dp, rest = section.split("Mean ΔP of the deepest half")[1].split("Mean effective pre-sublayer norm gain")
    gains, losses = rest.split("Validation loss of the measured windows")
    losses, downstream = losses.split("Downstream: hellaswag acc_norm")
    assert "| lns | 0.0100 | 0.0800 |" in deep_dp and "| lns | 0.3000 | 0.3000 |" in gains
    assert "| pre_ln | – | – |" in gains  # older analyses hold no gains
    assert "| lns_gain_init | 4.0600 | 4.0900 |" in losses
    assert "| pre_ln | – | 0.2500 |" in downstream and "| lns | 0.5000 | 0.7500 |" in downstream
    assert "| lns_gain_init | – | – |" in downstream  # not evaluated: blank
    with open(files["layers"]) as handle:
        layers = list(csv.DictReader(handle))
    assert len(layers) == 3 * 2 * 4  # schemes x steps x layers
    compare_report = tmp_path / "_study/depth/compare/depth16x64_lr3e-3/step600/report.md"
    assert "lns_gain_init_s1234" in compare_report.read_text()
    # analyses are kept: a second collect reads them back instead of measuring again
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda *a: pytest.fail("measured again"))
    assert collect_depth(study, planned)["depth report"].read_text() == report

    from lnstrain.checkpoint.errors import CheckpointError

    def refuse_lns_gain_init(step_dir, depth, name, trust):  # as the run's own key would refuse a forgery
        if name.startswith("lns_gain_init"):
            raise CheckpointError(f"{step_dir}: FORGED")
        return fake_analysis(step_dir, depth, name, trust)

    monkeypatch.setattr(study_depth, "analyse_checkpoint", refuse_lns_gain_init)
    shutil.rmtree(tmp_path / "_study/depth/runs")  # the earlier collect's analyses: measure again
    refused = collect_depth(study, planned)["depth report"].read_text()
    assert "Not analysed: the run's own checkpoint checks refused these checkpoints" in refused
    assert "- depth16x64_lns_gain_init_lr3e-3_s1234 step 600: " in refused and "FORGED" in refused
    assert "| `lns_deep_layers_matter_more` | lns | ✗ | ✓ | 614K |" in refused  # the rest of the study goes on


def test_depth_archive_combines_sessions_and_refuses_other_runs(tmp_path, monkeypatch):
    """A second session without the first one's checkpoints reads their analyses from the archive; an
    archived analysis of a run trained otherwise (another lr) is reported stale and not used."""
    corpus = build_tiny_corpus(tmp_path / "corpus")
    study = load_study(REPO / "configs/studies/depth_turn.yaml")
    study.spec.output_dir, study.spec.data_prefix = str(tmp_path / "session1"), str(corpus.prefix)
    study.spec.tokenizer, study.spec.schemes, study.spec.seeds = str(corpus.tokenizer), ["pre_ln", "lns"], [1234]
    study.spec.set = [f"data.valid_sources=[{{prefix: {corpus.prefix}}}]"]  # not the study's own corpus
    study.spec.variants = {"lr3e-3": ["optim.lr=3e-3", "train.steps=600"]}
    study.spec.depth.data, study.spec.depth.archive = str(corpus.prefix), str(tmp_path / "archive")
    deep = {"pre_ln": 0.05, "lns": 0.02}
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda step_dir, depth, name, trust: synthetic(
        name, name.rsplit("_s", 1)[0], delta=(1.0, 0.5, deep[name.rsplit("_s", 1)[0]], 0.01)))
    monkeypatch.setattr("lnstrain.checkpoint.metadata.is_complete", lambda step_dir: True)
    planned = plan_study(study)
    for p in planned:
        for step in (300, 600):
            (p.config.run.dir / "checkpoints" / f"global_step{step}").mkdir(parents=True)
    first = collect_depth(study, planned)["depth report"].read_text()
    archived = sorted(str(path.relative_to(tmp_path / "archive")) for path in (tmp_path / "archive").rglob("*.json"))
    assert archived == [f"depth16x64_{scheme}_lr3e-3_s1234/step{step}.json"
                        for scheme in ("lns", "pre_ln") for step in (300, 600)]

    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda *a: pytest.fail("measured again"))
    assert "read from the archive" not in collect_depth(study, planned)["depth report"].read_text()  # kept here
    study.spec.output_dir = str(tmp_path / "session2")  # no checkpoints, no earlier collect
    second = collect_depth(study, plan_study(study))["depth report"].read_text()
    assert "4 of these analyses were read from the archive" in second
    assert first.split("![")[0] == second.split("4 of these")[0].split("![")[0]  # the same tables

    study.spec.variants = {"lr3e-3": ["optim.lr=1e-3", "train.steps=600"]}  # same name, trained otherwise
    study.spec.output_dir = str(tmp_path / "session3")
    third = collect_depth(study, plan_study(study))["depth report"].read_text()
    assert "Not used from the archive" in third and "depth16x64_lns_lr3e-3_s1234 step 600" in third
    assert "Not analysed yet (no complete checkpoint): depth16x64_pre_ln_lr3e-3_s1234 step 300, 600" in third

    study.spec.output_dir = str(tmp_path / "session1")  # its earlier collect measured the lr 3e-3 runs
    measured = []
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda step_dir, depth, name, trust: measured.append(name) or
                        synthetic(name, name.rsplit("_s", 1)[0], delta=(1.0, 0.5, 0.03, 0.01)))
    collect_depth(study, plan_study(study))
    assert sorted(measured) == ["lns_s1234"] * 2 + ["pre_ln_s1234"] * 2  # not the other lr's analyses


def test_a_fresh_clone_regenerates_the_report_from_the_archive_alone(tmp_path, monkeypatch):
    """With neither the checkpoints nor the study's data (a fresh clone), collect takes each archived
    analysis whose run settings match and that was made on the data most of the archive was made on,
    and says that it could not check the data; a file made on other data, or one of format 1 (which
    records no settings of its own), is not used. With the data here, a format 1 file that matches is
    rewritten as format 2."""
    import json

    corpus = build_tiny_corpus(tmp_path / "corpus")
    study = load_study(REPO / "configs/studies/depth_turn.yaml")
    study.spec.output_dir, study.spec.data_prefix = str(tmp_path / "session1"), str(corpus.prefix)
    study.spec.tokenizer, study.spec.schemes, study.spec.seeds = str(corpus.tokenizer), ["pre_ln", "lns"], [1234, 1235]
    study.spec.set = [f"data.valid_sources=[{{prefix: {corpus.prefix}}}]"]
    study.spec.variants = {"lr3e-3": ["optim.lr=3e-3", "train.steps=300"]}
    archive = tmp_path / "archive"
    study.spec.depth.data, study.spec.depth.archive = str(corpus.prefix), str(archive)
    deep = {"pre_ln": 0.05, "lns": 0.02}
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda step_dir, depth, name, trust: synthetic(
        name, name.rsplit("_s", 1)[0], delta=(1.0, 0.5, deep[name.rsplit("_s", 1)[0]], 0.01)))
    monkeypatch.setattr("lnstrain.checkpoint.metadata.is_complete", lambda step_dir: True)
    for p in plan_study(study):
        (p.config.run.dir / "checkpoints" / "global_step300").mkdir(parents=True)
    first = collect_depth(study, plan_study(study))["depth report"].read_text()
    files = {path.parent.name: path for path in archive.rglob("step300.json")}
    assert len(files) == 4 and {json.loads(f.read_text())["format"] for f in files.values()} == {2}

    old = files["depth16x64_lns_lr3e-3_s1234"]  # as an earlier lnstrain wrote it
    record = json.loads(old.read_text())
    legacy = {key: value for key, value in record.items() if key not in ("settings", "trained_on")}
    old.write_text(json.dumps({**legacy, "format": 1}))
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda *a: pytest.fail("measured again"))
    study.spec.output_dir = str(tmp_path / "session2")  # no checkpoints; the data is here: it vouches for it
    assert "4 of these analyses were read from the archive" in collect_depth(study, plan_study(study))["depth report"].read_text()
    assert json.loads(old.read_text()) == record  # rewritten as format 2, with the same hashes

    shutil.move(tmp_path / "corpus", tmp_path / "elsewhere")  # a fresh clone: no data, no checkpoints
    study.spec.output_dir = str(tmp_path / "session3")
    alone = collect_depth(study, plan_study(study))["depth report"].read_text()
    assert "4 of these analyses were read from the archive" in alone
    assert "The study's data is not here, so 4 of the archived analyses could not be checked" in alone
    assert first.split("![")[0] == alone.split("![")[0]  # the same tables

    other = json.loads(files["depth16x64_pre_ln_lr3e-3_s1235"].read_text())
    files["depth16x64_pre_ln_lr3e-3_s1235"].write_text(json.dumps({**other, "trained_on": "0" * 32}))
    legacy = json.loads(files["depth16x64_lns_lr3e-3_s1235"].read_text())
    files["depth16x64_lns_lr3e-3_s1235"].write_text(json.dumps({**legacy, "format": 1}))
    study.spec.output_dir = str(tmp_path / "session4")
    mixed = collect_depth(study, plan_study(study))["depth report"].read_text()
    assert "2 of these analyses were read from the archive" in mixed
    assert ("Not used from the archive " + str(archive) + " (made from another config or data): "
            "depth16x64_pre_ln_lr3e-3_s1235 step 300; depth16x64_lns_lr3e-3_s1235 step 300") in mixed


def test_an_archived_analysis_survives_a_key_added_at_its_default(tmp_path):
    """run_hashes hashes the settings that differ from their defaults: a model key added to lnstrain
    later (at a default) keeps the hash, a changed setting changes it."""
    import dataclasses

    from lnstrain.model.config import ModelConfig
    from lnstrain.study.depth_archive import run_hashes
    from lnstrain.config.run_config import load_config
    from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides

    corpus = build_tiny_corpus(tmp_path / "corpus")
    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, tmp_path / "runs"), 1)
    before = run_hashes(config).trained_as
    Later = dataclasses.make_dataclass("Later", [("a_key_added_later", int, dataclasses.field(default=7))],
                                       bases=(ModelConfig,))
    config.model = Later(**dataclasses.asdict(config.model))
    assert run_hashes(config).trained_as == before
    config.model.a_key_added_later = 8
    assert run_hashes(config).trained_as != before
    config.model.a_key_added_later, config.optim.lr = 7, config.optim.lr * 2
    assert run_hashes(config).trained_as != before


def test_collect_puts_downstream_accuracy_beside_perplexity(tmp_path):
    """Finished runs (final_metrics.json) of which some were evaluated on lm-eval tasks at their last step."""
    study = load_study(REPO / "configs/studies/depth_turn.yaml")
    study.spec.output_dir = str(tmp_path)
    study.spec.seeds = [1234]
    study.spec.variants = {"lr3e-3": ["optim.lr=3e-3", "train.steps=600"]}
    planned = plan_study(study)
    for p in planned:
        p.config.run.dir.mkdir(parents=True)
        (p.config.run.dir / FINAL_METRICS_FILE).write_text('{"step": 600, "tokens": 614400, "eval_loss": 3.5, '
                                                          '"eval_ppl": 33.12}')
    scores = {"pre_ln": {"arc_easy": {"acc": 0.40, "acc_norm": 0.30}, "piqa": {"acc": 0.55}},
              "lns": {"arc_easy": {"acc": 0.45, "acc_norm": 0.35}}}
    for p in planned:
        if p.run.scheme in scores:
            write_results({"metrics": scores[p.run.scheme]}, downstream_file(p.config.run.dir, 600))
    write_results({"metrics": {"arc_easy": {"acc": 0.9}}}, downstream_file(planned[0].config.run.dir, 300))  # not final
    rows, files = collect_results(planned, tmp_path / "_study", study.spec.sizes, study.spec.schemes, "t")
    with open(files["csv"]) as handle:
        table = {row["scheme"]: row for row in csv.DictReader(handle)}
    assert table["pre_ln"]["downstream arc_easy acc_norm"] == "0.3" and table["pre_ln"]["downstream piqa acc"] == "0.55"
    assert table["lns"]["downstream piqa acc"] == "" and table["lns_gain_init"]["downstream arc_easy acc_norm"] == ""
    markdown = files["markdown"].read_text()
    assert ("| size | parameters | pre_ln lr3e-3 ppl | lns lr3e-3 ppl | lns_gain_init lr3e-3 ppl | "
            "pre_ln lr3e-3 arc_easy acc_norm | lns lr3e-3 arc_easy acc_norm | lns_gain_init lr3e-3 arc_easy acc_norm |"
            in markdown)
    assert "| 33.12 | 33.12 | 33.12 | 0.3000 | 0.3500 | — | 0.5500 | — | — |" in markdown
    assert "| depth16x64_lns_lr3e-3_s1234 | 3.5000 | 33.12 | 0.3500 | — | 614400 | done |" in markdown
