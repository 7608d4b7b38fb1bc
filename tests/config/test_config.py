"""Config loading: typing, collected problems, suggestions, composition, overrides, round trips."""

import pytest
import yaml

from lnstrain.config.deepspeed_json import deepspeed_config
from lnstrain.config.loader import ConfigError, apply_overrides
from lnstrain.config.run_config import Config, config_from_dict, load_config
from lnstrain.model.config import NormScheme

TINY = {
    "model": {"preset": "tiny", "norm_scheme": "lns"},
    "data": {"seq_len": 16},
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 10},
}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_preset_expands_and_keys_override_it():
    config = config_from_dict(TINY)
    assert config.model.hidden_size == 32 and config.model.num_layers == 3
    assert config.model.norm_scheme is NormScheme.LNS


def test_misspelt_keys_are_all_reported_with_suggestions():
    data = {**TINY, "optim": {"lr": 1e-3, "warmup_stpes": 5}, "trian": {}}
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    problems = error.value.problems
    assert "unknown key 'optim.warmup_stpes' (did you mean 'warmup_steps'?)" in problems
    assert "unknown key 'trian' (did you mean 'train'?)" in problems


def test_bad_enum_and_types_are_reported_together():
    data = {**TINY, "model": {"preset": "tiny", "norm_scheme": "lns_afer_norm"},
            "optim": {"lr": "fast"}, "precision": {"dtype": "bf61"}}
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    text = str(error.value)
    assert "model.norm_scheme" in text and "optim.lr: expected a number" in text
    assert "precision.dtype" in text and "'bf16'" in text
    assert len(error.value.problems) == 3


def test_yaml_exponent_without_dot_is_a_float():
    config = config_from_dict({**TINY, "optim": {"lr": "3e-4"}})
    assert config.optim.lr == pytest.approx(3e-4)


def test_cross_section_problems_name_the_keys():
    config = config_from_dict({**TINY, "parallel": {"tensor": 3, "pipeline": 4, "zero_stage": 3}})
    problems = config.validate(world_size=12)
    joined = "\n".join(problems)
    assert "model.num_heads (4) must be divisible by parallel.tensor (3)" in joined
    assert "model.num_layers (3) is smaller than parallel.pipeline (4)" in joined
    assert "parallel.zero_stage 3 cannot be combined with pipeline" in joined


def test_global_batch_divisibility_suggests_a_value():
    config = config_from_dict({**TINY, "train": {"global_batch_size": 10, "micro_batch_size": 2, "steps": 1}})
    (problem,) = [p for p in config.validate(world_size=4) if "global_batch_size" in p]
    assert "(2 × 4 = 8)" in problem and "try train.global_batch_size: 8" in problem


def test_base_files_compose_and_overrides_win(tmp_path):
    write(tmp_path, "recipe.yaml", {"optim": {"lr": 1e-3, "name": "adam"}, "train": TINY["train"]})
    path = write(tmp_path, "run.yaml", {"base": "recipe.yaml", "model": TINY["model"],
                                         "data": TINY["data"], "optim": {"lr": 5e-4}})
    config = load_config(path, overrides=["train.steps=20", "model.norm_scheme=pre_ln"], validate=False)
    assert config.optim.lr == 5e-4 and config.optim.name == "adam"
    assert config.train.steps == 20 and config.model.norm_scheme is NormScheme.PRE_LN


def test_override_creates_missing_sections():
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_resolved_config_round_trips(tmp_path):
    config = config_from_dict(TINY)
    config.save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml", validate=False)
    assert again == config


def test_deepspeed_json_follows_the_config():
    config = config_from_dict({**TINY, "precision": {"dtype": "fp16"}, "parallel": {"zero_stage": 2},
                               "deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000}}})
    ds = deepspeed_config(config, world_size=2)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    # the user's bucket wins; the all-gather bucket keeps lnstrain's cap at the rank's parameters (2**20 here)
    # two data-parallel ranks: ZeRO reduces each bucket during the backward (overlap_comm)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "allgather_bucket_size": 2**20,
                                       "overlap_comm": True}
    assert "overlap_comm" not in deepspeed_config(config, world_size=1)["zero_optimization"]  # nothing to overlap
    bf16_zero1 = config_from_dict({**TINY, "parallel": {"zero_stage": 1}})  # BF16_Optimizer: reduces after backward
    assert "overlap_comm" not in deepspeed_config(bf16_zero1, world_size=2)["zero_optimization"]


def test_steps_from_token_budget():
    config = config_from_dict({**TINY, "train": {"global_batch_size": 8, "micro_batch_size": 2,
                                                 "tokens": 1000}})
    assert config.tokens_per_step == 128 and config.total_steps == 8
    assert isinstance(config, Config)


def test_typing_problems_do_not_hide_the_checks_of_everything_else():
    """A misspelt key and a wrong type are reported with the layout problem; the unreadable value keeps its
    default for the checks, and a check that would judge that default is left out."""
    from lnstrain.config.run_config import read_config

    data = {**TINY, "optim": {"lrr": 1e-3}, "parallel": {"pipeline": 4},
            "train": {"global_batch_size": 8, "micro_batch_size": "two", "steps": "ten"}}
    typed = read_config(data)
    assert typed.problems == ["train.micro_batch_size: expected an integer, got 'two'",
                              "train.steps: expected an integer, got 'ten'",
                              "unknown key 'optim.lrr' (did you mean 'lr'?)"]
    checks = typed.value.validate(world_size=4, check_files=False)
    assert "model.num_layers (3) is smaller than parallel.pipeline (4); every stage needs at least one layer" in checks
    judged_defaults = [p for p in checks if typed.about_unreadable_keys(p)]
    assert judged_defaults == ["give exactly one of train.steps and train.tokens (got steps=None, tokens=None)"]


def test_an_unreadable_list_item_or_section_keeps_the_default_and_names_its_keys():
    from lnstrain.config.run_config import read_config

    typed = read_config({**TINY, "data": {"sources": [{"weight": 2}, {"prefix": "b", "weight": "heavy"}]},
                         "logging": 5})
    assert typed.problems == ["missing required key 'data.sources[0].prefix'",
                              "data.sources[1].weight: expected a number, got 'heavy'",
                              "logging: expected a mapping of LoggingConfig keys, got 5"]
    assert typed.value.data.sources == [] and typed.value.logging.interval == 10
    assert typed.about_unreadable_keys("data.sources is empty: list at least one {prefix: ...}")
    assert typed.about_unreadable_keys("logging.interval must be >= 1")
    assert not typed.about_unreadable_keys("data.seq_len (16) exceeds model.max_seq_len")
    assert not typed.about_unreadable_keys("nothing to log in this message")


def test_every_malformed_override_is_reported_without_a_traceback():
    with pytest.raises(ConfigError) as error:
        apply_overrides({}, ["optim.lr", "data.sources=[{prefix: a", "=3"])
    assert len(error.value.problems) == 3
    assert "'data.sources=[{prefix: a': the value is not valid YAML" in error.value.problems[1]
