"""The order in which interleaved runners take their timed steps (``timing.interleaved_order``)."""

from __future__ import annotations

from collections import Counter

import pytest

from lnstrain.benchmark.timing import interleaved_order


def _cycle(runners: int) -> list[list[int]]:
    return [interleaved_order(runners, index) for index in range(runners if runners % 2 == 0 else 2 * runners)]


def test_two_runners_alternate_as_before():
    assert [interleaved_order(2, index) for index in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]


@pytest.mark.parametrize("runners", [3, 4, 5, 6, 7])
def test_each_runner_holds_each_position_and_follows_each_other_equally_often(runners):
    rows = _cycle(runners)
    assert all(sorted(row) == list(range(runners)) for row in rows)
    positions = Counter((position, runner) for row in rows for position, runner in enumerate(row))
    assert set(positions.values()) == {len(rows) // runners} and len(positions) == runners ** 2
    successions = Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(successions) == runners * (runners - 1) and len(set(successions.values())) == 1


@pytest.mark.parametrize("runners", [3, 4, 5, 6, 7])
def test_no_runner_steps_twice_in_a_row_across_rounds(runners):
    """The alternation before it (A B C D E, E D C B A) let the first and last runner step twice in a row."""
    sequence = [runner for _ in range(3) for row in _cycle(runners) for runner in row]
    assert all(a != b for a, b in zip(sequence, sequence[1:]))


def test_no_runner_is_refused():
    with pytest.raises(ValueError, match="at least one runner"):
        interleaved_order(0, 0)
