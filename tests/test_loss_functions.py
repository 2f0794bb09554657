"""Every built-in loss against an independent float64 oracle: values and gradients, both sides of every clip bound.

The oracle is written from shared/LOSSES.md token by token in plain Python (math), with hand-derived gradients
with respect to the learner logprob ``lp``; the implementation under test is the trainer's torch code.
"""

from __future__ import annotations

import math

import pytest
import torch

from yieldloop.errors import InvalidArgumentError
from yieldloop_server.trainer import losses

# Ratios r = exp(lp - q) placed on both sides of the PPO bounds (0.8, 1.2) and the CISPO upper bound (4.0),
# never on a bound, with positive and negative advantages; the last two positions are prompt tokens (A = 0).
RATIOS = [0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0, 3.9, 4.1, 6.0, 0.3, 1.5, 0.9, 1.3]
ADVANTAGES = [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0]
NEG = [-0.7, -1.3, -0.4, -2.0, -1.1, -0.9, -0.5, -1.7, -1.0, -0.6, -0.8, -1.2, -0.3, -1.4]


def tensors(dtype: torch.dtype = torch.float32):
    q = torch.tensor([-1.0 - 0.1 * i for i in range(len(RATIOS))], dtype=torch.float64)
    lp = (q + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).to(dtype).requires_grad_(True)
    A = torch.tensor(ADVANTAGES, dtype=dtype)
    w = torch.tensor([1.0, 0.5, 2.0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=dtype)
    return lp, q.to(dtype), A, w


def oracle(name: str, lp: list[float], q: list[float], A: list[float], w: list[float], **knobs: float):
    """(value, d value / d lp) per LOSSES.md, in float64, one token at a time."""
    value, grad = 0.0, []
    for lp_i, q_i, a, w_i in zip(lp, q, A, w, strict=True):
        r = math.exp(lp_i - q_i)
        if name == "cross_entropy":
            value -= lp_i * w_i
            grad.append(-w_i)
        elif name == "importance_sampling":
            value -= r * a
            grad.append(-r * a)
        elif name == "ppo":
            lo, hi = knobs["clip_low_threshold"], knobs["clip_high_threshold"]
            clipped = min(max(r, lo), hi)
            unclipped_term, clipped_term = r * a, clipped * a
            value -= min(unclipped_term, clipped_term)
            # The min picks the clipped term only when it is smaller; it is constant in lp outside [lo, hi].
            takes_clipped = clipped_term < unclipped_term
            grad.append(0.0 if takes_clipped and clipped != r else -r * a)
        elif name == "cispo":
            lo, hi = knobs["clip_low_threshold"], knobs["clip_high_threshold"]
            weight = min(max(r, lo), hi)
            value -= weight * lp_i * a
            grad.append(-weight * a)
        elif name == "dro":
            beta = knobs["beta"]
            mask = 1.0 if a != 0 else 0.0
            value -= lp_i * a - 0.5 * beta * (lp_i - q_i) ** 2 * mask
            grad.append(-(a - beta * (lp_i - q_i) * mask))
    return value, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
        ("cispo", {}),
        ("cispo", {"clip_low_threshold": 0.85, "clip_high_threshold": 1.1}),
        ("dro", {}),
        ("dro", {"beta": 0.7}),
    ],
)
def test_loss_value_and_gradient_match_the_oracle(name: str, knobs: dict, dtype: torch.dtype) -> None:
    spec, resolved = losses.resolve(name, knobs)
    lp, q, A, w = tensors(dtype)
    value = spec.fn(lp, q, A, w, **resolved)
    value.backward()
    expected_value, expected_grad = oracle(name, lp.tolist(), q.tolist(), A.tolist(), w.tolist(), **resolved)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(value.double(), torch.tensor(expected_value, dtype=torch.float64), **tolerance)
    torch.testing.assert_close(lp.grad.double(), torch.tensor(expected_grad, dtype=torch.float64), **tolerance)


def test_ppo_gradient_is_zero_exactly_on_clipped_tokens() -> None:
    lp, q, A, w = tensors()
    spec, knobs = losses.resolve("ppo", {})
    spec.fn(lp, q, A, w, **knobs).backward()
    grad = lp.grad.tolist()
    for r, a, g in zip(RATIOS, ADVANTAGES, grad, strict=True):
        clipped = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
        assert (g == 0.0) == (clipped or a == 0), (r, a, g)
    assert sum(1 for g in grad if g == 0.0) >= 6  # 1.21, 2.0, 3.9, 4.1, 6.0 with A>0; 0.3 with A<0; prompt tokens


def test_cispo_keeps_a_gradient_on_every_action_token() -> None:
    lp, q, A, w = tensors()
    spec, knobs = losses.resolve("cispo", {})
    spec.fn(lp, q, A, w, **knobs).backward()
    for r, a, g in zip(RATIOS, ADVANTAGES, lp.grad.tolist(), strict=True):
        if a != 0:
            assert g != 0.0, (r, a)
            assert g == pytest.approx(-min(max(r, 0.0), 4.0) * a, rel=1e-5)  # clipped weight, never zeroed


def test_dro_quadratic_term_is_masked_to_action_tokens() -> None:
    lp, q, A, w = tensors()
    spec, knobs = losses.resolve("dro", {"beta": 1.0})
    spec.fn(lp, q, A, w, **knobs).backward()
    assert lp.grad[-1] == 0.0 and lp.grad[-2] == 0.0  # prompt tokens: no advantage, no penalty


def test_knobs_are_listed_validated_and_defaulted() -> None:
    assert set(losses.LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
    assert losses.LOSSES["ppo"].knobs == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert losses.LOSSES["cispo"].knobs == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert losses.resolve("dro", {})[1] == {"beta": losses.DRO_DEFAULT_BETA}
    with pytest.raises(InvalidArgumentError, match="no knob") as err:
        losses.resolve("importance_sampling", {"clip_low_threshold": 0.5})
    assert err.value.field == "config.loss_fn_config"
    with pytest.raises(InvalidArgumentError, match="unknown loss") as err:
        losses.resolve("grpo", {})
    assert err.value.reason == "LOSS_UNKNOWN"
