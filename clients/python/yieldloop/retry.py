"""The one retry policy: exponential backoff with jitter.

Used wherever yieldloop retries on its own (a rollout following a model's head, episodes retried after an
infrastructure error): the wait doubles from ``initial_s`` up to ``max_s``, each wait drawn uniformly from
``[1 - jitter, 1 + jitter]`` times that, so a fleet that lost a service does not come back in lockstep.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.2
    max_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.5
    """Fraction of each wait drawn at random (0: none)."""

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt`` (0 for the first retry)."""
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * (1 + self.jitter * (2 * (rng or random).random() - 1))
