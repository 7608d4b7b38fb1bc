"""The offline analyses on models whose answers are known in advance."""

import math

import pytest
import torch

from lnstrain.analysis.angular import angular_distance, distance_by_offset, pairwise_angular_distance
from lnstrain.analysis.depth_analysis import analyze_model, measure_representations, summarize
from lnstrain.analysis.pruning import (
    MultipleChoiceItem, choice_log_likelihoods, layer_pruning, layer_skipped, load_multiple_choice,
    multiple_choice_accuracy,
)
from lnstrain.analysis.representations import residual_stream
from tests.analysis.conftest import silence_layers, tiny_model


def test_identical_orthogonal_and_opposite_vectors():
    x = torch.randn(3, 5, 32)
    assert angular_distance(x, x.clone()).abs().max() < 1e-7
    assert angular_distance(x, 7.5 * x).abs().max() < 1e-7  # scale does not matter
    torch.testing.assert_close(angular_distance(x, -x), torch.ones(3, 5, dtype=torch.float64))
    e1, e2 = torch.eye(2)
    assert float(angular_distance(e1, e2)) == pytest.approx(0.5)
    sums = pairwise_angular_distance([x, x.clone(), -x])
    torch.testing.assert_close(sums, torch.tensor([[0.0, 0, 15], [0, 0, 15], [15, 15, 0]], dtype=torch.float64))


def test_angular_distances_taken_in_token_chunks_add_up_to_the_whole():
    states = [torch.randn(3, 50, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    whole = pairwise_angular_distance(states)
    chunked = pairwise_angular_distance(states, chunk_elements=5 * 16 * 7)  # 7 tokens a chunk, the last one short
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    assert float(whole[0, 1]) > 10  # 150 tokens of random directions: about 0.5 each


def test_distance_by_offset_layout():
    matrix = torch.arange(16, dtype=torch.float64).view(4, 4)  # 3 layers, 4 states
    grid = distance_by_offset(matrix)
    assert grid == [[1.0, 6.0, 11.0], [2.0, 7.0, None], [3.0, None, None]]


def test_identity_layers_have_no_effect_at_all(batches):
    model = silence_layers(tiny_model(num_layers=4))
    baseline, pruned = layer_pruning(model, batches)
    assert [p.layer for p in pruned] == [1, 2, 3, 4]
    for p in pruned:
        assert abs(p.delta_loss) < 1e-6 and abs(p.delta_perplexity) < 1e-4
    variance, angular = measure_representations(model, batches)
    assert max(max(row) for row in angular) < 1e-6
    assert max(variance) - min(variance) < 1e-9 * max(variance)
    summary = summarize(pruned, threshold=1e-3)
    assert summary.near_identity_layers == [1, 2, 3, 4] and summary.deep_half_share == 0.0


@pytest.mark.parametrize("active", [2, 4])
def test_a_single_active_layer_is_the_only_one_that_matters(batches, active):
    model = silence_layers(tiny_model(num_layers=4, init_std=0.2), keep=(active,))
    _, pruned = layer_pruning(model, batches)
    deltas = {p.layer: p.delta_loss for p in pruned}
    assert abs(deltas[active]) > 1e-3
    assert all(abs(d) < 1e-6 for layer, d in deltas.items() if layer != active)
    _, angular = measure_representations(model, batches)
    for i in range(5):  # state i enters layer i + 1; layer `active` separates states < active from the rest
        for j in range(5):
            crosses = min(i, j) < active <= max(i, j)
            assert (angular[i][j] > 1e-3) if crosses else (angular[i][j] < 1e-6), (i, j)
    summary = summarize(pruned, threshold=1e-3)
    assert summary.near_identity_layers == [n for n in range(1, 5) if n != active] or deltas[active] < 0
    assert summary.deep_half_share == (1.0 if active > 2 else 0.0) or deltas[active] < 0


def test_layer_skipped_is_the_identity_and_restores_the_model():
    model = tiny_model(num_layers=3).eval()
    tokens = torch.randint(0, 100, (2, 16))
    before = model(tokens)
    states = residual_stream(model, tokens)
    with layer_skipped(model, 2):
        skipped = model(tokens)
        torch.testing.assert_close(model.layers[1](states[1]), states[1], rtol=0, atol=0)
    layer3_without_2 = model.layers[2](states[1])
    torch.testing.assert_close(skipped, model.output(layer3_without_2, model.embedding.word_embeddings.weight))
    torch.testing.assert_close(model(tokens), before)
    assert [b.layer_number for b in model.layers] == [1, 2, 3]


def test_residual_stream_has_num_layers_plus_one_states():
    model = tiny_model(num_layers=3).eval()
    tokens = torch.randint(0, 100, (2, 16))
    states = residual_stream(model, tokens)
    assert len(states) == 4
    torch.testing.assert_close(states[0], model.embedding(tokens))
    torch.testing.assert_close(states[3], model.layers[2](model.layers[1](model.layers[0](states[0]))))


def test_choice_log_likelihood_is_the_sum_of_token_log_probs():
    model = tiny_model(num_layers=2).eval().requires_grad_(False)
    item = MultipleChoiceItem(context=[5, 6, 7], choices=[[8, 9], [10], [11, 12, 13]], answer=0)
    scores = choice_log_likelihoods(model, item, max_seq_len=16)
    for choice, score in zip(item.choices, scores):
        tokens = torch.tensor([item.context + choice])
        log_probs = torch.log_softmax(model(tokens[:, :-1])[0, :, :100], dim=-1)
        expected = sum(float(log_probs.detach()[3 + k - 1, t]) for k, t in enumerate(choice))
        assert score == pytest.approx(expected, abs=1e-5)
    best = max(range(3), key=scores.__getitem__)
    right = MultipleChoiceItem(item.context, item.choices, best)
    wrong = MultipleChoiceItem(item.context, item.choices, (best + 1) % 3)
    assert multiple_choice_accuracy(model, [right, wrong], 16) == 0.5


def test_pruning_reports_accuracy_changes(batches):
    model = silence_layers(tiny_model(num_layers=2))
    items = [MultipleChoiceItem([1, 2], [[3], [4, 5]], 0), MultipleChoiceItem([6], [[7], [8]], 1)]
    baseline, pruned = layer_pruning(model, batches, items)
    assert baseline.accuracy is not None and all(p.delta_accuracy == 0.0 for p in pruned)
    analysis = analyze_model(model, batches, name="silent", items=items)
    assert analysis.baseline.perplexity == pytest.approx(math.exp(analysis.baseline.loss))


def test_multiple_choice_jsonl(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text('{"question": "ab", "choices": ["c", "dd"], "answer": 1}\n\n'
                    '{"question": "x", "choices": ["c", "dd", "e"], "answer": "e"}\n'
                    '{"question": "x", "choices": ["c", "dd"], "answer": "B"}\n')
    items = load_multiple_choice(path, lambda text: [ord(ch) % 100 for ch in text], context_prefix=[0])
    assert [item.answer for item in items] == [1, 2, 1]
    assert items[0].context == [0, 97, 98] and items[0].choices == [[99], [0, 0]]
    path.write_text('{"question": "x", "choices": ["c", "d"], "answer": "z z"}\n')
    with pytest.raises(ValueError, match=r"task.jsonl:1: answer 'z z' is not one of the choices"):
        load_multiple_choice(path, list)
    path.write_text('{"question": "x", "answer": 0}\n')
    with pytest.raises(ValueError, match=r"missing \['choices'\]"):
        load_multiple_choice(path, list)
