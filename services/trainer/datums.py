"""Training data: datums, and Runs turned into datums with GRPO advantages.

A datum is one sequence where position i predicts target i. A Run becomes one
datum over its last turn's full context: its completion tokens of every turn
are action tokens carrying the run's advantage; prompt and tool-output
tokens carry none. Each turn's prompt must extend the previous turn's
prompt + completion exactly (no retokenization drift), or the run is refused.

Plain Python: no grpc here.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

from yieldloop.errors import InvalidArgumentError


def _datum_error(message: str, field: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, reason="DATUM_INVALID", field=field)


@dataclasses.dataclass
class Datum:
    input_tokens: list[int]
    target_tokens: list[int]
    sampling_logprobs: list[float]
    advantages: list[float]
    weights: list[float]

    def validate(self, vocab_size: int, field: str = "datum") -> Datum:
        """Checks lengths, finiteness and token ids; raises INVALID_ARGUMENT naming the field."""
        num = len(self.input_tokens)
        if num == 0:
            raise _datum_error("a datum needs at least one token", f"{field}.input_tokens")
        for name in ("target_tokens", "sampling_logprobs", "advantages", "weights"):
            values = getattr(self, name)
            if name in ("sampling_logprobs", "advantages", "weights") and not values:
                setattr(self, name, [0.0] * num)
            elif len(values) != num:
                raise _datum_error(
                    f"{name} has {len(values)} entries but input_tokens has {num}", f"{field}.{name}"
                )
        for name in ("sampling_logprobs", "advantages", "weights"):
            if not all(math.isfinite(v) for v in getattr(self, name)):
                raise _datum_error(f"{name} holds NaN or inf", f"{field}.{name}")
        for name in ("input_tokens", "target_tokens"):
            bad = [t for t in getattr(self, name) if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgumentError(
                    f"{name} holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                    reason="TOKEN_OUT_OF_VOCAB",
                    field=f"{field}.{name}",
                )
        return self


@dataclasses.dataclass
class TurnData:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]


@dataclasses.dataclass
class RunData:
    group_id: str
    reward: float
    turns: list[TurnData]


@dataclasses.dataclass
class GroupStats:
    num_groups: int = 0
    num_groups_without_signal: int = 0


def group_advantages(rewards: Sequence[float], normalize_by_std: bool, eps: float = 1e-6) -> list[float]:
    """GRPO advantages: reward minus the group mean, optionally divided by (std + eps)."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def stitch_turns(turns: Sequence[TurnData], field: str = "run") -> tuple[list[int], list[float], list[bool]]:
    """A run's full context: tokens, sampling logprobs (0 off-policy) and which tokens the model sampled.

    Each turn's prompt must extend the previous turns' prompt + completion exactly.
    """
    tokens: list[int] = []
    logprobs: list[float] = []
    is_action: list[bool] = []
    for t, turn in enumerate(turns):
        if len(turn.completion_logprobs) != len(turn.completion_token_ids):
            raise _datum_error(
                f"turn {t}: {len(turn.completion_logprobs)} logprobs for {len(turn.completion_token_ids)} tokens",
                f"{field}.turns.completion_logprobs",
            )
        if list(turn.prompt_token_ids[: len(tokens)]) != tokens:
            raise _datum_error(f"turn {t}'s prompt does not extend the previous turns", f"{field}.turns.prompt_token_ids")
        extra = list(turn.prompt_token_ids[len(tokens):])
        tokens += extra + list(turn.completion_token_ids)
        logprobs += [0.0] * len(extra) + list(turn.completion_logprobs)
        is_action += [False] * len(extra) + [True] * len(turn.completion_token_ids)
    return tokens, logprobs, is_action


def run_to_datum(run: RunData, advantage: float, field: str) -> Datum:
    """One datum over the run's full context, completion tokens of every turn as actions."""
    if not run.turns:
        raise _datum_error("a run needs at least one turn", f"{field}.turns")
    tokens, logprobs, is_action = stitch_turns(run.turns, field)
    if len(tokens) < 2 or not any(is_action[1:]):
        raise _datum_error("a run needs a prompt and at least one completion token", f"{field}.turns")
    return Datum(
        input_tokens=tokens[:-1],
        target_tokens=tokens[1:],
        sampling_logprobs=logprobs[1:],
        advantages=[advantage if a else 0.0 for a in is_action[1:]],
        weights=[1.0 if a else 0.0 for a in is_action[1:]],
    )


def runs_to_datums(
    runs: Sequence[RunData],
    *,
    normalize_by_std: bool = False,
    drop_groups_without_signal: bool = False,
    reward_scale: float = 1.0,
    group_size: int = 0,
    allow_incomplete_groups: bool = False,
) -> tuple[list[Datum], GroupStats]:
    """Datums with group-centred advantages; groups with equal rewards are counted (and optionally dropped).

    With ``group_size``, a group of another size is refused (GROUP_INCOMPLETE) unless
    ``allow_incomplete_groups``: a missing rollout silently shifts every advantage of its group.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for i, run in enumerate(runs):
        if not math.isfinite(run.reward):
            raise _datum_error(f"run {i} has a non-finite reward", f"runs[{i}].reward")
        groups[run.group_id or f"__single_{i}"].append(i)
    stats = GroupStats(num_groups=len(groups))
    by_run: dict[int, Datum] = {}
    for group_id, members in groups.items():
        if group_size and len(members) != group_size and not allow_incomplete_groups:
            raise InvalidArgumentError(
                f"group {group_id!r} has {len(members)} runs, not {group_size} (allow_incomplete_groups to accept)",
                reason="GROUP_INCOMPLETE",
                field="runs",
            )
        rewards = [runs[i].reward * reward_scale for i in members]
        if max(rewards) == min(rewards):
            stats.num_groups_without_signal += 1
            if drop_groups_without_signal:
                continue
        for i, advantage in zip(members, group_advantages(rewards, normalize_by_std), strict=True):
            by_run[i] = run_to_datum(runs[i], advantage, f"runs[{i}]")
    return [by_run[i] for i in sorted(by_run)], stats  # in the runs' order
