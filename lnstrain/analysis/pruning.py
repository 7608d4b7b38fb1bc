"""Layer pruning: remove one layer at a time (the block passes its input through) and measure what is lost.

ΔP(l) is the change of a validation metric when layer l alone is skipped: validation loss and
perplexity, and optionally accuracy on a multiple-choice task scored by per-choice log-likelihood.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lnstrain.analysis.model_source import DepthModel, as_depth_model
from lnstrain.analysis.progress import Progress
from lnstrain.analysis.representations import Batch


@dataclass
class EvalResult:
    loss: float
    """Mean next-token cross-entropy (nats) over the tokens the loss masks count."""
    perplexity: float
    tokens: int
    accuracy: float | None = None
    """Multiple-choice accuracy, when a task was given."""


@dataclass
class LayerPruning:
    """The model with layer `layer` skipped, and its change from the full model (positive: worse loss)."""

    layer: int
    result: EvalResult
    delta_loss: float
    delta_perplexity: float
    delta_accuracy: float | None = None


@dataclass
class MultipleChoiceItem:
    """One question: context token ids, one token-id list per choice, and the right choice's index."""

    context: list[int]
    choices: list[list[int]]
    answer: int


@contextmanager
def layer_skipped(model: nn.Module | DepthModel, layer_number: int) -> Iterator[None]:
    """Within the block, layer `layer_number` passes its input through unchanged."""
    with as_depth_model(model).layer_skipped(layer_number):
        yield


@torch.no_grad()
def evaluate_loss(model: nn.Module | DepthModel, batches: Sequence[Batch]) -> tuple[float, int]:
    """(token-weighted mean cross-entropy, number of counted tokens) over the batches."""
    model = as_depth_model(model)
    total, count = 0.0, 0
    for batch in batches:
        logits = model.logits(batch.tokens.to(model.input_device))
        labels, mask = batch.labels.to(logits.device), batch.loss_mask.to(logits.device).float()
        for row in range(logits.shape[0]):  # one sequence's logits in fp32 at a time: a large vocabulary's are big
            per_token = F.cross_entropy(logits[row, :, :model.vocab_size].float(), labels[row], reduction="none")
            total += float((per_token * mask[row]).sum())
        count += int(mask.sum())
    if count == 0:
        raise ValueError("no validation tokens: every loss_mask is zero")
    return total / count, count


@torch.no_grad()
def choice_log_likelihoods(model: nn.Module | DepthModel, item: MultipleChoiceItem, max_seq_len: int) -> list[float]:
    """Sum of log p(choice tokens | context) for each choice (contexts cut from the left to fit)."""
    model = as_depth_model(model)
    sequences, starts = [], []
    for choice in item.choices:
        if not choice:
            raise ValueError("a multiple-choice answer tokenized to nothing")
        sequence = (item.context + choice)[-(max_seq_len + 1):]
        sequences.append(sequence)
        starts.append(max(len(sequence) - len(choice), 0))
    width = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence)
    logits = model.logits(tokens[:, :-1].to(model.input_device))
    log_probs = F.log_softmax(logits[..., :model.vocab_size].float(), dim=-1)
    tokens = tokens.to(log_probs.device)
    scores = []
    for row, (sequence, start) in enumerate(zip(sequences, starts)):
        positions = torch.arange(max(start, 1) - 1, len(sequence) - 1, device=log_probs.device)
        scores.append(float(log_probs[row, positions, tokens[row, positions + 1]].sum()))
    return scores


def multiple_choice_accuracy(model: nn.Module | DepthModel, items: Sequence[MultipleChoiceItem],
                             max_seq_len: int) -> float:
    correct = 0
    for item in items:
        scores = choice_log_likelihoods(model, item, max_seq_len)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item.answer)
    return correct / len(items)


def evaluate(model: nn.Module | DepthModel, batches: Sequence[Batch], items: Sequence[MultipleChoiceItem] = (),
             max_seq_len: int | None = None) -> EvalResult:
    model = as_depth_model(model)
    with model.evaluating():
        loss, tokens = evaluate_loss(model, batches)
        accuracy = None
        if items:
            accuracy = multiple_choice_accuracy(model, items, max_seq_len or model.max_seq_len)
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=tokens, accuracy=accuracy)


def layer_pruning(model: nn.Module | DepthModel, batches: Sequence[Batch], items: Sequence[MultipleChoiceItem] = (),
                  max_seq_len: int | None = None,
                  progress: Progress | None = None) -> tuple[EvalResult, list[LayerPruning]]:
    """(full model's result, one LayerPruning per layer 1..L): L + 1 evaluations, each reported to `progress`."""
    model = as_depth_model(model)
    baseline = evaluate(model, batches, items, max_seq_len)
    if progress is not None:
        progress.done(f"full model: loss {baseline.loss:.4f}")
    pruned = []
    for number in range(1, model.num_layers + 1):
        with model.layer_skipped(number):
            result = evaluate(model, batches, items, max_seq_len)
        if progress is not None:
            progress.done(f"layer {number} skipped: loss {result.loss:.4f}")
        delta_accuracy = None if result.accuracy is None else result.accuracy - baseline.accuracy
        pruned.append(LayerPruning(layer=number, result=result, delta_loss=result.loss - baseline.loss,
                                   delta_perplexity=result.perplexity - baseline.perplexity,
                                   delta_accuracy=delta_accuracy))
    return baseline, pruned


def _answer_index(record: dict, where: str) -> int:
    answer, choices = record["answer"], record["choices"]
    if isinstance(answer, bool) or not isinstance(answer, (int, str)):
        raise ValueError(f"{where}: 'answer' must be a choice index, a choice's text or a letter")
    if isinstance(answer, int):
        index = answer
    elif answer in choices:
        index = choices.index(answer)
    elif len(answer) == 1 and answer.isalpha():
        index = ord(answer.upper()) - ord("A")
    else:
        raise ValueError(f"{where}: answer {answer!r} is not one of the choices")
    if not 0 <= index < len(choices):
        raise ValueError(f"{where}: answer index {index} out of range for {len(choices)} choices")
    return index


def load_multiple_choice(path: str | Path, encode, context_prefix: Sequence[int] = (),
                         encode_choice=None) -> list[MultipleChoiceItem]:
    """Read a JSONL task: one {"question": str, "choices": [str, ...], "answer": index | text | letter}
    per line. `encode(text) -> list[int]` tokenizes; `context_prefix` (e.g. the document separator)
    goes before each question. Each choice is tokenized on its own, as a continuation:
    `encode_choice(question, choice) -> list[int]` when given, else `encode(choice)`."""
    items = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from e
            missing = [key for key in ("question", "choices", "answer") if key not in record]
            if missing or not isinstance(record["choices"], list) or len(record["choices"]) < 2:
                raise ValueError(f"{where}: need 'question', 'choices' (a list of at least 2) and 'answer'; "
                                 f"missing {missing}" if missing else f"{where}: 'choices' must list at least 2")
            items.append(MultipleChoiceItem(context=list(context_prefix) + list(encode(record["question"])),
                                            choices=[list(encode_choice(record["question"], c) if encode_choice
                                                          else encode(c)) for c in record["choices"]],
                                            answer=_answer_index(record, where)))
    if not items:
        raise ValueError(f"{path}: no questions")
    return items
