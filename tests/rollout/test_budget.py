"""The asynchrony budget: the forms a user writes, and clear errors for the rest."""

from __future__ import annotations

import pytest

from periodic_rl.rollout.budget import KL_BUDGET_MAX_STALENESS, AsynchronyBudget, parse_budget
from periodic_rl.rollout.options import RolloutOptions


def test_the_three_forms():
    assert parse_budget("on_policy") == AsynchronyBudget(0)
    assert parse_budget({"max_staleness": 2}) == AsynchronyBudget(2)
    assert parse_budget({"max_staleness": 2.0}) == AsynchronyBudget(2)  # YAML may give a float
    kl = parse_budget({"max_mismatch_kl": 0.01})
    assert kl == AsynchronyBudget(KL_BUDGET_MAX_STALENESS, 0.01)
    assert parse_budget({"max_mismatch_kl": 0.01, "max_staleness": 1}) == AsynchronyBudget(1, 0.01)


def test_what_a_budget_allows():
    assert AsynchronyBudget(0).allows(0) and not AsynchronyBudget(0).allows(1)
    two = AsynchronyBudget(2)
    assert two.allows(2) and not two.allows(3) and not two.allows(-1)
    kl = AsynchronyBudget(2, 0.01)
    assert kl.allows(1) and kl.allows(1, 0.01) and not kl.allows(1, 0.02)
    assert kl.allows(0, 5.0)  # on-policy is inside every budget: the mismatch is the engine's


@pytest.mark.parametrize(
    "value, names",
    [
        ("off_policy", "on_policy"),
        ({"staleness": 1}, "unknown key"),
        ({}, "unknown key"),
        ({"max_staleness": -1}, ">= 0"),
        ({"max_staleness": 1.5}, "whole number"),
        ({"max_mismatch_kl": 0}, "positive number"),
        ({"max_mismatch_kl": float("nan")}, "positive number"),
    ],
)
def test_a_wrong_budget_names_the_problem_and_the_forms(value, names):
    with pytest.raises(ValueError, match="asynchrony") as error:
        parse_budget(value)
    assert names in str(error.value)


def test_a_budget_and_a_fixed_staleness_together_are_refused():
    with pytest.raises(ValueError, match="give one of them"):
        RolloutOptions(engine="hf", max_staleness=1, asynchrony=AsynchronyBudget(2))
    options = RolloutOptions(engine="hf", asynchrony=AsynchronyBudget(2))
    assert options.staleness_bound == 2
    assert RolloutOptions(engine="hf", max_staleness=3).staleness_bound == 3
    assert RolloutOptions(engine="hf", asynchrony=AsynchronyBudget(0)).staleness_bound == 0
