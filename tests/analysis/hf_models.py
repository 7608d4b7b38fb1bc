"""Tiny random Hugging Face models of each supported family, saved to disk with a tiny tokenizer.

Nothing is downloaded: the configs are built here, the weights drawn from a seed (norm gains too,
so that a wrong gain shows), and the tokenizer is a byte-level BPE trained on the tiny corpus with
the `tokenizers` library. LLaMA-like families get a tokenizer that puts BOS first, Qwen-like ones
one that adds nothing, as the real ones do.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
NUM_LAYERS = 4
BOS, EOS = "<s>", "<|endoftext|>"

_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
              tie_word_embeddings=False)


def family_config(family: str):
    """A 4-layer config; Mistral and Qwen2 with a sliding window shorter than the test windows (Qwen2's
    only on layers 3-4, so that a layer's mask depends on its index)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**_SHAPE)
    if family == "mistral":
        return transformers.MistralConfig(**_SHAPE, sliding_window=8)
    if family == "qwen2":
        return transformers.Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    if family == "qwen3":
        return transformers.Qwen3Config(**_SHAPE, head_dim=8)
    raise ValueError(family)


def save_bpe_tokenizer(directory: Path, documents: list[str], add_bos: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS if add_bos else None,
                            eos_token=EOS).save_pretrained(str(directory))


def save_tiny_model(directory: Path, family: str, documents: list[str], seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    save_bpe_tokenizer(directory, documents, add_bos=family in ("llama", "mistral"))
    return directory
