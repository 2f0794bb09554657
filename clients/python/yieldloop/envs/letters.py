"""The ``letters`` environment: the embedded default's small, learnable task family.

Each task asks the model to write one letter over and over; the reward is the
fraction of non-space characters in the answer that are that letter, so a
random policy scores low but not zero and every group has reward spread.
"""

from __future__ import annotations

import string

from yieldloop.environment import Environment, Grade

env = Environment("letters")

LETTERS = string.ascii_lowercase


def letter_fraction(answer: str, letter: str) -> float:
    """Fraction of the answer's non-space characters equal to ``letter`` (0 for an empty answer)."""
    chars = [c for c in answer if not c.isspace()]
    return sum(c == letter for c in chars) / len(chars) if chars else 0.0


@env.tool()
def count_letter(text: str, letter: str) -> int:
    """Counts how many times `letter` occurs in `text`."""
    return text.count(letter)


@env.scenario()
async def repeat(letter: str):
    """Write only the given lowercase letter, as many times as you like."""
    if len(letter) != 1 or letter not in LETTERS:
        raise ValueError(f"letter must be one lowercase ASCII letter, got {letter!r}")
    answer = yield f"Write the letter {letter} over and over."
    yield Grade(letter_fraction(answer, letter), info={"letter": letter, "length": len(answer)})


def tasks(letters: str = LETTERS) -> list:
    """One ``repeat`` task per letter."""
    return [repeat.task(letter=c) for c in letters]
