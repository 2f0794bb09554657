"""The ``letters`` environment: the embedded default's small, learnable task family.

Each task asks for one letter written at least eight times. The reward is
the fraction of the answer that is that letter times how far it got towards
eight of them, so ``"qqqqqqqq"`` (or longer) scores 1, ``"qq"`` 0.25,
``"qqqqqqqqx"`` 0.89 and a wrong letter nothing; answers in between get
partial credit, so groups have reward spread.

The letters split into training tasks (a-p) and held-out tasks (q-z): the
held-out letters never appear in a training task, so a gain on them is the
model learning the task, not the answers. The tiny base model's warm-up
(``yieldloop_server.common.tiny_model``) echoes letters one to four times
for other prompts; it never sees these prompts or an answer this long.
"""

from __future__ import annotations

import string

from yieldloop.environment import Environment, Grade

env = Environment("letters")

LETTERS = string.ascii_lowercase
TRAIN_LETTERS = LETTERS[:16]
HELDOUT_LETTERS = LETTERS[16:]
TARGET_LENGTH = 8


def letter_reward(answer: str, letter: str, target: int = TARGET_LENGTH) -> float:
    """(share of the answer's non-space characters that are ``letter``) * min(1, their count / ``target``)."""
    chars = [c for c in answer if not c.isspace()]
    count = sum(c == letter for c in chars)
    return count / len(chars) * min(1.0, count / target) if chars else 0.0


@env.scenario()
async def repeat(letter: str):
    """Write the given lowercase letter at least eight times."""
    if len(letter) != 1 or letter not in LETTERS:
        raise ValueError(f"letter must be one lowercase ASCII letter, got {letter!r}")
    answer = yield f'Write the letter "{letter}" at least eight times.'
    yield Grade(letter_reward(answer, letter), info={"letter": letter, "length": len(answer)})


def tasks(letters: str = LETTERS) -> list:
    """One ``repeat`` task per letter."""
    return [repeat.task(letter=c) for c in letters]


TASKS = {"train_tasks": f"{__name__}:train_tasks", "heldout_tasks": f"{__name__}:heldout_tasks"}
"""The demo's tasksets, as a loop config names them: ``LoopConfig(**TASKS)``."""


def train_tasks() -> list:
    """The training tasks (letters a-p)."""
    return tasks(TRAIN_LETTERS)


def heldout_tasks() -> list:
    """The held-out tasks (letters q-z), disjoint from the training tasks."""
    return tasks(HELDOUT_LETTERS)
