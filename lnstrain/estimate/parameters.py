"""How many parameters each rank holds: a layer's share per tensor rank, each pipeline stage's
(transformer layers split evenly, extra layers first, unless boundaries are given; the embedding on
the first stage, the final norm and the output head on the last), and the largest single tensor.

Read by the memory estimate and by the DeepSpeed JSON (bucket sizes follow what one rank holds).
"""

from __future__ import annotations

from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.norm_schemes import has_final_norm, norms_per_block


def stage_layer_counts(num_layers: int, pipeline: int, boundaries: list[int] | None = None) -> list[int]:
    """Transformer layers per stage: the explicit boundaries, else an even split (extra layers first)."""
    if boundaries:
        return list(boundaries)
    base, extra = divmod(num_layers, pipeline)
    return [base + (1 if stage < extra else 0) for stage in range(pipeline)]


def layer_parameters_per_rank(model: ModelConfig, tensor: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    norm_size = model.hidden_size * (2 if model.norm_type == "layernorm" else 1)
    final_norm = norm_size if has_final_norm(model.norm_scheme) else 0
    per_layer = (model.num_parameters(include_embeddings=False) - final_norm) // model.num_layers
    replicated = norms_per_block(model.norm_scheme) * norm_size
    if model.norm_scheme == NormScheme.LAYERSCALE:
        replicated += 2 * model.hidden_size
    return (per_layer - replicated) // tensor + replicated


def stage_parameters(model: ModelConfig, tensor: int, pipeline: int, stage: int, layers: int) -> int:
    """Parameters held by one rank of ``stage``."""
    embedding = model.padded_vocab_size(tensor) * model.hidden_size // tensor
    norm_size = model.hidden_size * (2 if model.norm_type == "layernorm" else 1)
    count = layers * layer_parameters_per_rank(model, tensor)
    if stage == 0:
        count += embedding
    if stage == pipeline - 1:
        count += norm_size if has_final_norm(model.norm_scheme) else 0
        if not model.tie_embeddings or pipeline > 1:
            count += embedding
    return count


def largest_stage_parameters(model: ModelConfig, tensor: int, pipeline: int,
                             boundaries: list[int] | None = None) -> int:
    """The most parameters any one rank holds (the heaviest stage's)."""
    counts = stage_layer_counts(model.num_layers, pipeline, boundaries)
    return max(stage_parameters(model, tensor, pipeline, stage, layers) for stage, layers in enumerate(counts))


def largest_tensor_elements(model: ModelConfig, tensor: int) -> int:
    """Elements of the largest parameter on one tensor rank (an embedding or a fused projection)."""
    embedding = model.padded_vocab_size(tensor) * model.hidden_size // tensor
    qkv = (model.hidden_size + 2 * model.kv_heads * model.head_dim) * model.hidden_size // tensor
    return max(embedding, qkv, 2 * model.ffn_hidden_size * model.hidden_size // tensor)
