"""`AsynchronyBudget`: how off-policy a run may be, stated once; the run picks its schedule inside.

The strategy's ``asynchrony`` argument takes one of:

- ``"on_policy"``: every group is trained by the weights that generated it (``k = 0``);
- ``{"max_staleness": k}``: a group may have been generated up to ``k`` versions before the
  weights that train it;
- ``{"max_mismatch_kl": x}``: any staleness (up to :data:`KL_BUDGET_MAX_STALENESS`, or the
  ``max_staleness`` given with it) whose measured engine/trainer KL (``mismatch/kl``, the mean
  k3 estimate over the sampled tokens) stays at most ``x``; a window measured above ``x`` sends
  the run back to fresher rollouts.

Within the budget :class:`~periodic_rl.rollout.chooser.ScheduleChooser` picks the schedule from
what the run measures. The bound itself is enforced where groups are trained
(:func:`~periodic_rl.on_policy.check_on_policy`), whatever the chooser does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: The staleness a ``max_mismatch_kl`` budget may reach when no ``max_staleness`` bounds it.
KL_BUDGET_MAX_STALENESS = 4

AsynchronySpec = Literal["on_policy"] | dict[str, float]

_KEYS = ("max_staleness", "max_mismatch_kl")
_EXAMPLES = "'on_policy', {max_staleness: 1} or {max_mismatch_kl: 0.001}"


@dataclass(frozen=True)
class AsynchronyBudget:
    """The most a run may lag: ``max_staleness`` versions; with ``max_mismatch_kl`` also only
    while the measured ``mismatch/kl`` stays at most that."""

    max_staleness: int = 0
    max_mismatch_kl: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            raise ValueError(
                f"asynchrony: max_staleness must be a whole number of versions, got "
                f"{self.max_staleness!r}"
            )
        if self.max_staleness < 0:
            raise ValueError(
                f"asynchrony: max_staleness must be >= 0 (0: on-policy), got {self.max_staleness}"
            )
        kl = self.max_mismatch_kl
        if kl is not None and not (isinstance(kl, int | float) and math.isfinite(kl) and kl > 0):
            raise ValueError(
                f"asynchrony: max_mismatch_kl must be a positive number (a mean KL per token, "
                f"e.g. 0.001), got {kl!r}"
            )

    @property
    def on_policy(self) -> bool:
        return self.max_staleness == 0

    def allows(self, staleness: int, measured_kl: float | None = None) -> bool:
        """Whether a schedule ``staleness`` versions behind, with ``measured_kl`` (when known),
        is inside the budget."""
        if not 0 <= staleness <= self.max_staleness:
            return False
        bound = self.max_mismatch_kl
        return bound is None or staleness == 0 or measured_kl is None or measured_kl <= bound

    def describe(self) -> str:
        if self.on_policy:
            return "on_policy"
        if self.max_mismatch_kl is not None:
            return f"max_mismatch_kl {self.max_mismatch_kl:g} (staleness <= {self.max_staleness})"
        return f"max_staleness {self.max_staleness}"


def parse_budget(value: AsynchronySpec | AsynchronyBudget) -> AsynchronyBudget:
    """The budget an ``asynchrony`` argument states, or a ValueError naming what is wrong and
    the forms it takes."""
    if isinstance(value, AsynchronyBudget):
        return value
    if value == "on_policy":
        return AsynchronyBudget(0)
    if not isinstance(value, Mapping):
        raise ValueError(f"asynchrony: got {value!r}; give {_EXAMPLES}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown or not value:
        raise ValueError(
            f"asynchrony: unknown key(s) {unknown} in {dict(value)!r}; the keys are "
            f"{list(_KEYS)}, e.g. {_EXAMPLES}"
        )
    params: dict[str, Any] = dict(value)
    if "max_staleness" in params and isinstance(params["max_staleness"], float):
        if not params["max_staleness"].is_integer():
            raise ValueError(
                f"asynchrony: max_staleness must be a whole number of versions, got "
                f"{params['max_staleness']!r}"
            )
        params["max_staleness"] = int(params["max_staleness"])
    if "max_mismatch_kl" in params:
        params.setdefault("max_staleness", KL_BUDGET_MAX_STALENESS)
    return AsynchronyBudget(**params)
