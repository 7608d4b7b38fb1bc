"""Full (single-process) tensors -> this rank's shards, for any layout, with readable mismatches.

``apply_full_state_dict`` loads a full state dict (a consolidated checkpoint, a Hugging Face import)
into this rank's model: the single-process ``Transformer`` or a tensor-parallel one, or one
pipeline stage. Before touching a weight it compares names and shapes with what the config's model
has and raises ``StateDictMismatchError`` listing every missing, unexpected and wrongly shaped entry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from lnstrain.checkpoint.param_names import (fit_rows, is_vocab_sharded, module_name_mapper, owner_of,
                                             single_process_shapes)
from lnstrain.model.config import ModelConfig

logger = logging.getLogger(__name__)

_LISTED = 12  # entries shown per kind of mismatch


class StateDictMismatchError(ValueError):
    """A state dict that does not fit the model; ``missing``, ``unexpected``, ``wrong_shape`` list why."""

    def __init__(self, source: str, cfg: ModelConfig, missing: list[str], unexpected: list[str],
                 wrong_shape: list[tuple[str, tuple, tuple]]) -> None:
        self.missing, self.unexpected, self.wrong_shape = missing, unexpected, wrong_shape
        lines = [f"{source} does not fit the model of this config (hidden_size={cfg.hidden_size}, "
                 f"num_layers={cfg.num_layers}, num_heads={cfg.num_heads}, num_kv_heads={cfg.kv_heads}, "
                 f"ffn_hidden_size={cfg.ffn_hidden_size}, vocab_size={cfg.vocab_size}, "
                 f"tie_embeddings={cfg.tie_embeddings}, norm_type={cfg.norm_type}, "
                 f"norm_scheme={getattr(cfg.norm_scheme, 'value', cfg.norm_scheme)}):"]
        lines += _section("wrong shape", [f"{n}: file {list(a)}, model {list(b)}" for n, a, b in wrong_shape])
        lines += _section("missing from the file", missing)
        lines += _section("in the file but not in the model", unexpected)
        super().__init__("\n".join(lines))


def _section(title: str, entries: list[str]) -> list[str]:
    if not entries:
        return []
    shown = [f"    {e}" for e in entries[:_LISTED]]
    more = [f"    ... and {len(entries) - _LISTED} more"] if len(entries) > _LISTED else []
    return [f"  {title} ({len(entries)}):", *shown, *more]


def check_full_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "state dict") -> None:
    """Raise ``StateDictMismatchError`` unless ``state_dict`` has exactly the single-process model's
    names and shapes (vocabulary rows may differ only in padding: ``vocab_size`` to the padded size)."""
    expected = single_process_shapes(cfg)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = []
    for name in sorted(set(expected) & set(state_dict)):
        have, want = tuple(state_dict[name].shape), tuple(expected[name])
        vocab_padding_only = (name in ("embedding.word_embeddings.weight", "output.head.weight")
                              and have[1:] == want[1:] and cfg.vocab_size <= have[0] <= want[0])
        if have != want and not vocab_padding_only:
            wrong.append((name, have, want))
    if missing or unexpected or wrong:
        raise StateDictMismatchError(source, cfg, missing, unexpected, wrong)


def local_shards(module: nn.Module, full: dict[str, torch.Tensor]) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """(name, parameter, this rank's shard of the full tensor) for every parameter of ``module``
    (a ``Transformer`` or a DeepSpeed pipeline stage) whose canonical name ``full`` holds."""
    canonical = module_name_mapper(module)
    for name, param in module.named_parameters():
        key = canonical(name)
        if key not in full:
            continue
        owner = owner_of(module, name)
        tensor = full[key]
        if is_vocab_sharded(owner):
            tensor = fit_rows(tensor, owner.padded_vocab_size if hasattr(owner, "padded_vocab_size")
                              else sum(p.size for p in owner.parts))
        yield name, param, (owner.shard(tensor) if hasattr(owner, "shard") else tensor)


def apply_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], groups=None,
                          model_cfg: ModelConfig | None = None, source: str = "state dict") -> None:
    """Copy a full state dict into this rank's ``module`` (any layout), after checking it fits.

    ``model_cfg`` defaults to ``module.cfg`` (a ``Transformer``); pass it for pipeline stages.
    ``groups`` is accepted for symmetry: the layers already know their ranks.
    """
    cfg = model_cfg if model_cfg is not None else getattr(module, "cfg", None)
    if cfg is None:
        raise ValueError("apply_full_state_dict: pass model_cfg for a module that is not a Transformer")
    check_full_state_dict(state_dict, cfg, source)
    with torch.no_grad():
        for name, param, shard in local_shards(module, state_dict):
            if shard.shape != param.shape:
                raise ValueError(f"{source}: {name} shards to {list(shard.shape)}, this rank holds {list(param.shape)}")
            param.copy_(shard.to(param.dtype))

