"""The LLaMA-family model with LayerNorm Scaling and tensor-parallel layers.

``lnstrain.model.build.build_model`` is how a run gets its (parallel) model; its module docstring says
how. It is not re-exported here: it reads the run's config, whose model section imports this package.
"""

from lnstrain.model.block import LayerScale, TransformerBlock
from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.init import init_weights
from lnstrain.model.loss import language_model_loss, weighted_token_loss
from lnstrain.model.norm_schemes import lns_factor
from lnstrain.model.presets import MODEL_PRESETS, model_preset
from lnstrain.model.transformer import EmbeddingStage, OutputStage, Transformer

__all__ = [
    "MODEL_PRESETS", "EmbeddingStage", "LayerScale", "ModelConfig", "NormScheme", "OutputStage",
    "Transformer", "TransformerBlock", "init_weights", "language_model_loss",
    "lns_factor", "model_preset", "weighted_token_loss",
]
