"""The LLaMA-family model with LayerNorm Scaling and tensor-parallel layers."""

from lnstrain.model.block import LayerScale, TransformerBlock
from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.init import init_weights
from lnstrain.model.norm_schemes import lns_factor
from lnstrain.model.presets import MODEL_PRESETS, model_preset
from lnstrain.model.transformer import EmbeddingStage, OutputStage, Transformer, language_model_loss

__all__ = [
    "MODEL_PRESETS", "EmbeddingStage", "LayerScale", "ModelConfig", "NormScheme", "OutputStage",
    "Transformer", "TransformerBlock", "init_weights", "language_model_loss", "lns_factor", "model_preset",
]
