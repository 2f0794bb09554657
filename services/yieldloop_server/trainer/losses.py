"""The built-in losses, exactly as shared/LOSSES.md states them.

Every loss takes per-token tensors of one flattened batch (shape N) and
returns the **sum** over tokens (Tinker's ``loss:sum``); other aggregations
are done by scaling the advantages. Only action tokens count: prompt and
tool-output positions carry ``A = 0`` (and ``w = 0``), and DRO's quadratic
term is masked to action tokens (``A != 0``) too.

Legend: ``lp_N`` learner logprob, ``q_N`` sampler logprob, ``A_N`` advantage,
``w_N`` cross-entropy weight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from yieldloop.errors import InvalidArgumentError

DRO_DEFAULT_BETA = 0.05


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A built-in loss: its function, knobs with defaults, a description, and what the trainer needs to know of
    it (which tokens it acts on, which knobs clip the ratio): the trainer never switches on a loss's name."""

    name: str
    fn: Callable[..., Any]
    knobs: dict[str, float]
    description: str
    knob_docs: dict[str, str] = dataclasses.field(default_factory=dict)
    acts_on: str = "advantages"
    """The datum field whose non-zero entries mark the tokens the loss acts on ("advantages", or "weights" for a
    supervised loss): its metrics are over those tokens, and a datum with none is not computed at all."""
    clipped_by: tuple[str, str] | None = None
    """The knobs bounding the importance ratio (low, high), when the loss clips it: the fraction of action tokens
    outside is reported (``clip_fraction``)."""


def cross_entropy(lp_N: Any, q_N: Any, A_N: Any, w_N: Any) -> Any:
    return -(lp_N * w_N).sum()


def importance_sampling(lp_N: Any, q_N: Any, A_N: Any, w_N: Any) -> Any:
    ratio_N = (lp_N - q_N).exp()
    return -(ratio_N * A_N).sum()


def ppo(lp_N: Any, q_N: Any, A_N: Any, w_N: Any, clip_low_threshold: float, clip_high_threshold: float) -> Any:
    import torch

    ratio_N = (lp_N - q_N).exp()
    clipped_N = ratio_N.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio_N * A_N, clipped_N * A_N).sum()


def cispo(lp_N: Any, q_N: Any, A_N: Any, w_N: Any, clip_low_threshold: float, clip_high_threshold: float) -> Any:
    ratio_N = (lp_N - q_N).exp()
    return -(ratio_N.clamp(clip_low_threshold, clip_high_threshold).detach() * lp_N * A_N).sum()


def dro(lp_N: Any, q_N: Any, A_N: Any, w_N: Any, beta: float) -> Any:
    action_N = (A_N != 0).to(lp_N.dtype)
    return -(lp_N * A_N - 0.5 * beta * (lp_N - q_N) ** 2 * action_N).sum()


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec(
            "cross_entropy",
            cross_entropy,
            {},
            "-(lp * w).sum(): supervised learning on weighted tokens.",
            acts_on="weights",
        ),
        LossSpec(
            "importance_sampling",
            importance_sampling,
            {},
            "-(exp(lp - q) * A).sum(): policy gradient corrected for the sampler/learner mismatch.",
        ),
        LossSpec(
            "ppo",
            ppo,
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "-min(r * A, clamp(r, lo, hi) * A).sum() with r = exp(lp - q).",
            {
                "clip_low_threshold": "lower bound on the ratio (absolute, not epsilon)",
                "clip_high_threshold": "upper bound on the ratio (absolute, not epsilon)",
            },
            clipped_by=("clip_low_threshold", "clip_high_threshold"),
        ),
        LossSpec(
            "cispo",
            cispo,
            {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            "-(clamp(r, lo, hi).detach() * lp * A).sum(): clipped IS weights, every token keeps its gradient.",
            {
                "clip_low_threshold": "lower bound on the detached ratio",
                "clip_high_threshold": "upper bound on the detached ratio",
            },
            clipped_by=("clip_low_threshold", "clip_high_threshold"),
        ),
        LossSpec(
            "dro",
            dro,
            {"beta": DRO_DEFAULT_BETA},
            "-(lp * A - 0.5 * beta * (lp - q)**2).sum(), quadratic term on action tokens only.",
            {"beta": "weight of the quadratic penalty keeping the learner near the sampler"},
        ),
    )
}


def resolve(name: str, config: dict[str, float]) -> tuple[LossSpec, dict[str, float]]:
    """The loss and its knobs (defaults filled in); unknown names are INVALID_ARGUMENT."""
    if name not in LOSSES:
        raise InvalidArgumentError(
            f"unknown loss {name!r}; available: {sorted(LOSSES)}", reason="LOSS_UNKNOWN", field="config.loss_fn"
        )
    spec = LOSSES[name]
    unknown = sorted(set(config) - set(spec.knobs))
    if unknown:
        raise InvalidArgumentError(
            f"loss {name!r} has no knob(s) {unknown}; knobs: {sorted(spec.knobs)}",
            reason="INVALID_FIELD",
            field="config.loss_fn_config",
        )
    knobs = {**spec.knobs, **config}
    for knob, value in knobs.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(
                f"loss knob {knob} must be a finite number >= 0, got {value!r}",
                reason="INVALID_FIELD",
                field=f"config.loss_fn_config.{knob}",
            )
    if knobs.get("clip_low_threshold", 0.0) > knobs.get("clip_high_threshold", math.inf):
        raise InvalidArgumentError(
            "clip_low_threshold must not exceed clip_high_threshold",
            reason="INVALID_FIELD",
            field="config.loss_fn_config.clip_low_threshold",
        )
    return spec, knobs
