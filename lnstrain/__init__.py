"""lnstrain: distributed pretraining of LLaMA-family models with LayerNorm Scaling."""

__version__ = "0.1.0"
