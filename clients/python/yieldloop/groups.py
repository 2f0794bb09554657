"""GRPO groups: the one owner of what a group is, its advantages, its reward spread, and runs as datums.

The client (reporting groups without spread, cutting a batch into substeps of whole groups) and the trainer
(advantages, datums) both call these, so "a group" has one definition: the runs sharing a ``group_id``; a
run without one is a group of its own.

A Run becomes one datum over its last turn's full context: its completion tokens of every turn are action
tokens carrying the run's advantage; prompt and tool-output tokens carry none. Each turn's prompt must
extend the previous turn's prompt + completion exactly (no retokenization drift), or the run is refused.

Plain Python: runs are anything with ``group_id``, ``reward``, ``status`` and ``turns`` (domain
:class:`~yieldloop.types.Run` objects or the protobuf messages); a string stands for a run by trace id.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from yieldloop.errors import InvalidArgumentError
from yieldloop.types import Datum, RunStatus, datum_error


def group_key(run: Any, index: int) -> str:
    """The group a run belongs to: its group id; a trace id, or a run without a group id, stands alone."""
    if isinstance(run, str):
        return run
    return run.group_id or f"__single_{index}"


def group_indices(runs: Sequence[Any]) -> dict[str, list[int]]:
    """Group key -> the indices of its runs, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        groups.setdefault(group_key(run, index), []).append(index)
    return groups


def check_group_sizes(runs: Sequence[Any], group_size: int, allow_incomplete_groups: bool = False) -> None:
    """Refuses a batch with a group of another size than ``group_size`` (0: any size).

    A missing rollout silently shifts every advantage of its group, so it is an error unless allowed.

    Raises:
        InvalidArgumentError: GROUP_INCOMPLETE naming the group.
    """
    if not group_size or allow_incomplete_groups:
        return
    for key, members in group_indices(runs).items():
        if len(members) != group_size:
            raise InvalidArgumentError(
                f"group {key!r} has {len(members)} runs, not {group_size} (allow_incomplete_groups to accept)",
                reason="GROUP_INCOMPLETE",
                field="runs",
            )


def group_advantages(rewards: Sequence[float], normalize_by_std: bool, eps: float = 1e-6) -> list[float]:
    """GRPO advantages: reward minus the group mean, optionally divided by (std + eps)."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def groups_without_spread(runs: Iterable[Any]) -> dict[str, float]:
    """Groups whose graded rewards are all equal (zero advantage: they teach nothing): group id -> reward."""
    rewards: dict[str, list[float]] = {}
    for run in runs:
        if not isinstance(run, str) and run.status == RunStatus.GRADED and run.group_id:
            rewards.setdefault(run.group_id, []).append(run.reward)
    return {gid: r[0] for gid, r in rewards.items() if len(r) > 1 and max(r) - min(r) < 1e-12}


def split_whole_groups(runs: Sequence[Any], num_slices: int) -> list[list[Any]]:
    """``runs`` cut into ``num_slices`` slices of whole groups (a GRPO group is never cut).

    Raises:
        InvalidArgumentError: num_substeps < 1, or more slices than groups.
    """
    if num_slices < 1:
        raise InvalidArgumentError("num_substeps must be >= 1", reason="INVALID_FIELD", field="num_substeps")
    groups = [[runs[i] for i in members] for members in group_indices(runs).values()]
    if num_slices > len(groups):
        raise InvalidArgumentError(
            f"{num_slices} substeps for {len(groups)} group(s)", reason="INVALID_FIELD", field="num_substeps"
        )
    return [[run for group in groups[i::num_slices] for run in group] for i in range(num_slices)]


@dataclasses.dataclass
class GroupStats:
    num_groups: int = 0
    num_groups_without_signal: int = 0


def stitch_turns(turns: Sequence[Any], field: str = "run") -> tuple[list[int], list[float], list[bool]]:
    """A run's full context: tokens, sampling logprobs (0 off-policy) and which tokens the model sampled.

    Each turn's prompt must extend the previous turns' prompt + completion exactly.
    """
    tokens: list[int] = []
    logprobs: list[float] = []
    is_action: list[bool] = []
    for t, turn in enumerate(turns):
        if len(turn.completion_logprobs) != len(turn.completion_token_ids):
            raise datum_error(
                f"turn {t}: {len(turn.completion_logprobs)} logprobs for {len(turn.completion_token_ids)} tokens",
                f"{field}.turns.completion_logprobs",
            )
        if list(turn.prompt_token_ids[: len(tokens)]) != tokens:
            raise datum_error(
                f"turn {t}'s prompt does not extend the previous turns", f"{field}.turns.prompt_token_ids"
            )
        extra = list(turn.prompt_token_ids[len(tokens) :])
        tokens += extra + list(turn.completion_token_ids)
        logprobs += [0.0] * len(extra) + list(turn.completion_logprobs)
        is_action += [False] * len(extra) + [True] * len(turn.completion_token_ids)
    return tokens, logprobs, is_action


def run_to_datum(run: Any, advantage: float, field: str) -> Datum:
    """One datum over the run's full context, completion tokens of every turn as actions."""
    if not run.turns:
        raise datum_error("a run needs at least one turn", f"{field}.turns")
    tokens, logprobs, is_action = stitch_turns(run.turns, field)
    if len(tokens) < 2 or not any(is_action[1:]):
        raise datum_error("a run needs a prompt and at least one completion token", f"{field}.turns")
    return Datum(
        input_tokens=tokens[:-1],
        target_tokens=tokens[1:],
        sampling_logprobs=logprobs[1:],
        advantages=[advantage if a else 0.0 for a in is_action[1:]],
        weights=[1.0 if a else 0.0 for a in is_action[1:]],
    )


def runs_to_datums(
    runs: Sequence[Any],
    *,
    normalize_by_std: bool = False,
    drop_groups_without_signal: bool = False,
    reward_scale: float = 1.0,
    group_size: int = 0,
    allow_incomplete_groups: bool = False,
) -> tuple[list[Datum], GroupStats]:
    """Datums with group-centred advantages; groups with equal rewards are counted (and optionally dropped).

    With ``group_size``, a group of another size is refused (GROUP_INCOMPLETE) unless
    ``allow_incomplete_groups``.
    """
    for i, run in enumerate(runs):
        if not math.isfinite(run.reward):
            raise datum_error(f"run {i} has a non-finite reward", f"runs[{i}].reward")
    check_group_sizes(runs, group_size, allow_incomplete_groups)
    groups = group_indices(runs)
    stats = GroupStats(num_groups=len(groups))
    by_run: dict[int, Datum] = {}
    for members in groups.values():
        rewards = [runs[i].reward * reward_scale for i in members]
        if max(rewards) == min(rewards):
            stats.num_groups_without_signal += 1
            if drop_groups_without_signal:
                continue
        for i, advantage in zip(members, group_advantages(rewards, normalize_by_std), strict=True):
            by_run[i] = run_to_datum(runs[i], advantage, f"runs[{i}]")
    return [by_run[i] for i in sorted(by_run)], stats  # in the runs' order
