"""The runs of a study: each size × (variant ×) scheme × seed composed into one resolved config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lnstrain.config.loader import apply_overrides, deep_merge, load_yaml_with_bases
from lnstrain.config.run_config import Config, config_from_dict
from lnstrain.study.spec import Study

@dataclass
class StudyRun:
    """One run of a study and its config (before the layout search)."""

    size: str
    scheme: str
    seed: int
    config: Config
    variant: str = ""
    """The study's variant (a named set of overrides); empty in a study without variants."""

    @property
    def name(self) -> str:
        return run_name(self.size, self.scheme, self.seed, self.variant)

    @property
    def dir(self) -> Path:
        return self.config.run.dir


def run_name(size: str, scheme: str, seed: int, variant: str = "") -> str:
    return f"{size}_{scheme}_{variant}_s{seed}" if variant else f"{size}_{scheme}_s{seed}"


def compose_run_config(study: Study, size: str, scheme: str, seed: int, variant: str = "") -> Config:
    """recipe ← size piece ← scheme piece ← the study's data, names and seed ← ``set`` overrides ←
    the size's ``size_set`` overrides ← the variant's overrides; then, with ``tokens_per_parameter``,
    the training length."""
    spec = study.spec
    name = run_name(size, scheme, seed, variant)
    data: dict = {}
    for piece in (study.path(spec.recipe), study.path(spec.sizes_dir) / f"{size}.yaml",
                  study.path(spec.schemes_dir) / f"{scheme}.yaml"):
        data = deep_merge(data, load_yaml_with_bases(piece))
    data = deep_merge(data, {
        "run": {"name": name, "output_dir": spec.output_dir},
        "data": {"sources": [{"prefix": spec.data_prefix, "weight": 1.0}], "tokenizer": spec.tokenizer},
        "train": {"seed": seed},
        "model": {"init_seed": seed},
    })
    overrides = spec.set + spec.size_set.get(size, []) + (spec.variants[variant] if variant else [])
    data = apply_overrides(data, overrides)
    config = config_from_dict(data, source=f"study run {name}")
    if spec.tokens_per_parameter is None:
        return config
    steps = round(spec.tokens_per_parameter * config.model.num_parameters(include_embeddings=False)
                  / config.tokens_per_step)
    return config_from_dict(deep_merge(data, {"train": {"steps": max(steps, 1), "tokens": None}}),
                            source=f"study run {name}")


def study_runs(study: Study) -> list[StudyRun]:
    """Every run: sizes in the study's order, then variants, then seeds, then schemes, so that a study
    run one after another (or cut short) completes whole scheme comparisons, one seed at a time."""
    spec = study.spec
    return [StudyRun(size, scheme, seed, compose_run_config(study, size, scheme, seed, variant), variant)
            for size in spec.sizes for variant in (list(spec.variants) or [""])
            for seed in spec.seeds for scheme in spec.schemes]
