"""Group advantages against numbers worked out by hand (TRL 1.16 GRPO definition, and RLOO)."""

from __future__ import annotations

import math

import pytest
import torch

from periodic_rl.algorithms import BASELINES, SCALE_REWARDS, group_advantages


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12
    )


R = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # two groups of G=2: [1,0], [0,1]


def test_constants():
    assert SCALE_REWARDS == ("group", "batch", "none")
    assert BASELINES == ("grpo", "rloo")


def test_grpo_none():
    # group means 0.5 and 0.5: advantages are reward - 0.5
    _close(group_advantages(R, 2, "none"), [0.5, -0.5, -0.5, 0.5])


def test_grpo_group():
    # unbiased std of [1, 0]: sqrt((0.25 + 0.25) / 1) = sqrt(0.5) = 0.70710678...
    # 0.5 / (0.70710678 + 1e-4) = 0.70700680...
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert a == pytest.approx(0.7070068, abs=1e-7)
    _close(group_advantages(R, 2, "group"), [a, -a, -a, a])
    _close(group_advantages(R, 2), [a, -a, -a, a])  # "group" is the default


def test_grpo_batch():
    # std over all four rewards: mean 0.5, squared deviations 4 * 0.25 = 1, / (4 - 1) -> 1/3,
    # sqrt(1/3) = 0.57735027...; 0.5 / (0.57735027 + 1e-4) = 0.86587556...
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert a == pytest.approx(0.8658755, abs=1e-7)
    _close(group_advantages(R, 2, "batch"), [a, -a, -a, a])


def test_grpo_uneven_group():
    # one group [3, 0, 0]: mean 1 -> [2, -1, -1]; deviations 2, -1, -1 -> sum of squares 6,
    # / 2 = 3, std sqrt(3) = 1.7320508...
    r = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    _close(group_advantages(r, 3, "none"), [2.0, -1.0, -1.0])
    s = math.sqrt(3) + 1e-4
    _close(group_advantages(r, 3, "group"), [2 / s, -1 / s, -1 / s])


def test_rloo_none():
    # G=2: the baseline of each sample is its sibling's reward
    _close(group_advantages(R, 2, "none", "rloo"), [1.0, -1.0, -1.0, 1.0])
    # [3, 0, 0]: baselines (0+0)/2 = 0, (3+0)/2 = 1.5, 1.5 -> [3, -1.5, -1.5]
    r = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    _close(group_advantages(r, 3, "none", "rloo"), [3.0, -1.5, -1.5])


def test_rloo_scaled():
    r = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    s = math.sqrt(3) + 1e-4  # std of the *rewards* [3, 0, 0], as for GRPO
    _close(group_advantages(r, 3, "group", "rloo"), [3 / s, -1.5 / s, -1.5 / s])
    # batch over R: std sqrt(1/3)
    b = math.sqrt(1 / 3) + 1e-4
    _close(group_advantages(R, 2, "batch", "rloo"), [1 / b, -1 / b, -1 / b, 1 / b])


def test_rloo_is_scaled_grpo():
    # leave-one-out advantage = G / (G - 1) * (reward - group mean)
    torch.manual_seed(0)
    r = torch.rand(12, dtype=torch.float64)
    for scale in SCALE_REWARDS:
        torch.testing.assert_close(
            group_advantages(r, 4, scale, "rloo"), group_advantages(r, 4, scale, "grpo") * 4 / 3
        )


def test_groups_are_independent():
    # group 1's values do not change group 0's advantages under "group" scaling
    a = group_advantages(torch.tensor([1.0, 0.0, 5.0, 7.0]), 2)
    b = group_advantages(torch.tensor([1.0, 0.0, -3.0, 9.0]), 2)
    torch.testing.assert_close(a[:2], b[:2])


def test_constant_group_is_zero():
    # std 0: (r - mean) = 0, divided by 1e-4 -> 0, not NaN
    r = torch.tensor([2.0, 2.0, 2.0, 1.0, 0.0, 0.5])
    out = group_advantages(r, 3, "group")
    _close(out[:3], [0.0, 0.0, 0.0])
    assert torch.isfinite(out).all()


def test_group_of_one_is_zero():
    r = torch.tensor([1.0, 0.0, 3.0])
    for scale in SCALE_REWARDS:
        _close(group_advantages(r, 1, scale), [0.0, 0.0, 0.0])


def test_dtype_and_integer_rewards():
    out = group_advantages(torch.tensor([1, 0, 0, 1]), 2, "none")
    assert out.dtype == torch.float32
    _close(out, [0.5, -0.5, -0.5, 0.5])
    assert group_advantages(R.float(), 2).dtype == torch.float32


def test_bad_input():
    with pytest.raises(ValueError, match="not divisible by group_size=2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="rloo.*group_size >= 2"):
        group_advantages(torch.zeros(4), 1, baseline="rloo")


def test_unknown_options_list_allowed_values():
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(R, 2, scale_rewards="true")
    with pytest.raises(ValueError, match="grpo, rloo"):
        group_advantages(R, 2, baseline="ppo")
