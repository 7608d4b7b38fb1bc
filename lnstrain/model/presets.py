"""Model size presets (LLaMA shapes, vocabulary 32000 unless noted).

The 60M-1B presets are the LNS paper's shapes (its Table 1 and appendix), FFN widths included; 7B is
LLaMA-7B's. The paper's 1B FFN width, 5461 (= 2/3 of 4 × 2048, not rounded), is odd: its matrix
products miss the GPU's tensor-core tiles and it cannot split over tensor ranks. ``1b_fast`` is the
same model with the width rounded up to a multiple of 256 as LLaMA does (5632, 3.1% more parameters):
the shape to train for speed, while ``1b`` is the one to reproduce the paper with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lnstrain.model.config import ModelConfig

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=100, hidden_size=32, ffn_hidden_size=64, num_layers=3, num_heads=4,
                 num_kv_heads=2, max_seq_len=16, make_vocab_size_divisible_by=8),
    "60m": dict(hidden_size=512, ffn_hidden_size=1376, num_layers=8, num_heads=8, max_seq_len=1024),
    "130m": dict(hidden_size=768, ffn_hidden_size=2048, num_layers=12, num_heads=12, max_seq_len=1024),
    "250m": dict(hidden_size=768, ffn_hidden_size=2560, num_layers=24, num_heads=16, max_seq_len=1024),
    "350m": dict(hidden_size=1024, ffn_hidden_size=2736, num_layers=24, num_heads=16, max_seq_len=1024),
    "1b": dict(hidden_size=2048, ffn_hidden_size=5461, num_layers=24, num_heads=32, max_seq_len=1024),
    "1b_fast": dict(hidden_size=2048, ffn_hidden_size=5461, ffn_multiple_of=256, num_layers=24, num_heads=32,
                    max_seq_len=1024),
    "7b": dict(hidden_size=4096, ffn_hidden_size=11008, num_layers=32, num_heads=32, max_seq_len=2048),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """A fresh ModelConfig for preset `name`, with `overrides` applied on top."""
    if name not in MODEL_PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}")
    cfg = ModelConfig(**MODEL_PRESETS[name])
    return dataclasses.replace(cfg, **overrides)
