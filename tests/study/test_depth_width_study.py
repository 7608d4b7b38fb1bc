"""The depth-width study's file (docs/depth_width_study.md): the same tokens per non-embedding
parameter at every size, the learning rate per width, and the checks of the keys that say so."""

from pathlib import Path

import pytest
import yaml

from lnstrain.config.loader import ConfigError
from lnstrain.study.plan import plan_study
from lnstrain.study.spec import load_study

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "configs/studies/depth_width.yaml"


def test_every_size_sees_the_first_studys_tokens_per_parameter():
    planned = {p.run.name: p for p in plan_study(load_study(STUDY))}
    assert len(planned) == 6 * 2 * 2 and not any(p.error for p in planned.values())
    steps = {name.split("_")[0]: p.config.total_steps for name, p in planned.items()}
    assert steps == {"depth8x64": 1200, "depth16x64": 2400, "depth32x64": 4800, "depth48x64": 7200,
                     "depth16x128": 9587, "depth16x192": 21562}
    anchor = planned["depth16x64_lns_s1234"]
    assert anchor.tokens == 2_457_600 and anchor.non_embedding_parameters == 804_928  # the first study's point
    for p in planned.values():  # within the rounding to whole steps of 1,024 tokens
        assert abs(p.tokens / p.non_embedding_parameters - 2_457_600 / 804_928) <= 512 / p.non_embedding_parameters


def test_peak_lr_falls_as_one_over_width_and_stays_with_depth():
    for p in plan_study(load_study(STUDY)):
        assert p.config.optim.lr == pytest.approx(3e-3 * 64 / p.config.model.hidden_size)
        assert p.config.checkpoint.keep_last == 2 and p.config.train.seed == p.config.model.init_seed == p.run.seed


def _study_file(tmp_path: Path, **changes) -> Path:
    study = yaml.safe_load(STUDY.read_text())
    study.update(recipe=str(REPO / "configs/recipes/depth_cpu.yaml"), sizes_dir=str(REPO / "configs/sizes"),
                 schemes_dir=str(REPO / "configs/schemes"), **changes)
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study, allow_unicode=True))
    return tmp_path / "study.yaml"


def test_length_overrides_sizes_and_axes_are_checked(tmp_path):
    depth = yaml.safe_load(STUDY.read_text())["depth"]
    depth["size_axes"] = {"depth": ["depth8x64"], "heads": ["depth16x64", "depth16x128"], "width": ["depth16x96",
                                                                                                     "depth16x64"]}
    path = _study_file(tmp_path, set=["train.steps=100"], size_set={"depth99x64": ["optim.lr=1e-3"]},
                       variants={"long": ["train.tokens=1000000"]}, depth=depth)
    with pytest.raises(ConfigError) as error:
        load_study(path)
    text = str(error.value)
    for problem in ("override 'train.steps=100': tokens_per_parameter sets every run's train.steps",
                    "override 'train.tokens=1000000'", "size_set: 'depth99x64' is not one of the sizes",
                    "depth.size_axes.depth: a trend needs at least two sizes",
                    "depth.size_axes: axis 'heads' must be one of ['depth', 'width']",
                    "depth.size_axes.width: 'depth16x96' is not one of the sizes"):
        assert problem in text
    assert "tokens_per_parameter must be positive" in str(pytest.raises(
        ConfigError, load_study, _study_file(tmp_path, tokens_per_parameter=0)).value)
