"""`equal_run_length`: the run of equal messages two successive lists share, found in one pass.

The token counter and the trace's prompt record follow each prompt against the one before it.
Where a long run differs somewhere (a late prompt's window of a thousand messages, with the
rules moved after the newest user message), the run's length was found by halving: two new
slices of the span at each of its ~11 steps. It is now the first pair of different objects
that do not compare equal, after one comparison of the whole span: the same length, with two
slices whatever the span.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from keel.messages import Message, equal_run_length


def _halving(
    messages: Sequence[Message], i: int, other: Sequence[Message], j: int, span: int
) -> int:
    """What `equal_run_length` answered before (the reference: the longest equal start)."""
    if messages[i : i + span] == other[j : j + span]:
        return span
    low, high = 1, span - 1
    while low < high:
        middle = (low + high + 1) // 2
        if messages[i : i + middle] == other[j : j + middle]:
            low = middle
        else:
            high = middle - 1
    return low


class _Slices(list[Message]):
    """A list that counts the slices taken of it."""

    slices = 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            type(self).slices += 1
        return super().__getitem__(index)


def test_the_run_is_the_longest_equal_start_as_halving_found_it() -> None:
    rng = random.Random(7)
    pool = [Message.user(f"message {n}") for n in range(40)]
    for _ in range(3000):
        size = rng.randint(1, 60)
        mine = [rng.choice(pool) for _ in range(size)]
        theirs = list(mine)
        for _ in range(rng.randint(0, 3)):
            at = rng.randrange(size)
            roll = rng.random()
            if roll < 0.4:
                # An equal message that is another object: still part of the run.
                theirs[at] = Message.user(mine[at].content)
            elif roll < 0.8:
                theirs[at] = Message.user(f"other {rng.randint(0, 9)}")
            else:
                theirs[at] = rng.choice(pool)
        i = rng.randrange(size)
        prefix = [Message.user(f"before {n}") for n in range(rng.randint(0, 3))]
        other = prefix + theirs
        other[len(prefix) + i] = mine[i]  # the first pair is one object, as callers know
        span = size - i
        assert equal_run_length(mine, i, other, len(prefix) + i, span) == _halving(
            mine, i, other, len(prefix) + i, span
        )


def test_a_long_run_that_differs_near_its_end_takes_two_slices() -> None:
    window = [Message.user(f"turn {n}") for n in range(1000)]
    before = _Slices(window)
    now = _Slices(window)
    now[700] = Message.system("the rules, moved")
    now[900] = Message.user("turn 900, masked again")  # equal content elsewhere is not reached
    _Slices.slices = 0
    assert equal_run_length(now, 0, before, 0, 1000) == 700
    assert _Slices.slices == 2
    assert equal_run_length(now, 701, before, 701, 299) == 199
    assert _Slices.slices == 4
