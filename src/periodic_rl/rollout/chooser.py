"""`ScheduleChooser`: the fastest staleness inside the asynchrony budget, from what a run measures.

A run with ``asynchrony`` (:mod:`periodic_rl.rollout.budget`) starts exactly on-policy (``k = 0``,
inside every budget). The strategy asks :meth:`ScheduleChooser.step` at the start of every
iteration. Each *window* is ``window`` iterations measured after one of warm-up (the run's
first iteration, and the first after a switch). A window's :class:`WindowMeasure` holds the
seconds between the trainer's iteration starts (the run's real pace), and per iteration the
seconds some rollout worker generated, the trainer trained and weights were pushed, and the
engine/trainer ``mismatch/kl``. From them :func:`decide` (pure: the same measurements always
give the same decision):

1. predicts the pace of each staleness ``k`` in ``1..budget`` (:func:`predict_period_s`: the
   two sides as a pipeline, generation of iteration ``j`` waiting for version ``j - k``) and
   switches to the smallest ``k`` within 1% of the fastest, if it is predicted faster than the
   measured on-policy pace by ``min_gain``;
2. one window later, compares what was measured with the prediction and keeps the switch only if
   the run really went faster than before it (else it goes back);
3. with ``max_mismatch_kl``, in every window after, a measured ``mismatch/kl`` above the bound
   sends the run back to ``k - 1`` and never higher again.

Every decision is one log line, with the predictions; the line after a switch says what was
measured. The chooser never leaves the budget: its candidates stop at the budget's
``max_staleness``, the controller refuses a staleness beyond it, and the trainer refuses a group
older than it (:func:`~periodic_rl.on_policy.check_on_policy`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from periodic_rl.rollout.budget import AsynchronyBudget
from periodic_rl.rollout.timing import SpanRecorder

#: Staleness values within this fraction of the fastest predicted count as equally fast (the
#: freshest of them is chosen).
TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class IterationTimes:
    """Seconds one iteration spent generating (some worker busy), training (the trainer neither
    waiting nor pushing) and pushing weights."""

    generation_s: float
    training_s: float
    push_s: float


@dataclass(frozen=True)
class WindowMeasure:
    """One measured window at ``staleness``: the mean seconds between iteration starts, each
    iteration's :class:`IterationTimes`, and the mean ``mismatch/kl`` (``None``: not reported)."""

    staleness: int
    period_s: float
    iterations: tuple[IterationTimes, ...]
    mismatch_kl: float | None = None


@dataclass(frozen=True)
class ScheduleDecision:
    """What one window says: the staleness to run from now on (``switch``: it differs from
    the one measured), the predictions it was chosen by (``k -> s/iteration``), and why."""

    measured: WindowMeasure
    staleness: int
    predicted_s: dict[int, float]
    reason: str
    final: bool

    @property
    def switch(self) -> bool:
        return self.staleness != self.measured.staleness

    def line(self) -> str:
        """The decision as one log line."""
        m = self.measured
        predicted = ", ".join(f"k={k}: {s:.2f}" for k, s in sorted(self.predicted_s.items()))
        kl = f", mismatch/kl {m.mismatch_kl:.3g}" if m.mismatch_kl is not None else ""
        return (
            f"asynchrony: k={m.staleness} measured {m.period_s:.2f} s/iteration over "
            f"{len(m.iterations)} iteration(s){kl}"
            + (f"; predicted s/iteration {predicted}" if predicted else "")
            + f"; {'switching to' if self.switch else 'keeping'} k={self.staleness}: {self.reason}"
        )

    def metrics(self, prefix: str = "asynchrony/") -> dict[str, float]:
        out = {
            f"{prefix}staleness": float(self.staleness),
            f"{prefix}measured_s": self.measured.period_s,
        }
        if self.staleness in self.predicted_s:
            out[f"{prefix}predicted_s"] = self.predicted_s[self.staleness]
        return out


def predict_period_s(times: Sequence[IterationTimes], staleness: int, cycles: int = 8) -> float:
    """Seconds per iteration of the two sides run as a pipeline ``staleness`` iterations deep,
    in steady state, from one window's per-iteration times (repeated ``cycles`` times).

    Iteration ``j`` is generated (after its push) once iteration ``j - 1`` is and version
    ``j - k`` exists, i.e. once iteration ``j - k - 1`` is trained; it is trained once it is
    generated and iteration ``j - 1`` is trained. With ``k = 0`` the sides take turns."""
    if not times:
        raise ValueError("no iteration measured")
    sequence = list(times) * cycles
    generated: list[float] = []
    trained: list[float] = []
    for j, t in enumerate(sequence):
        weights_ready = trained[j - staleness - 1] if j - staleness - 1 >= 0 else 0.0
        start = max(generated[-1] if generated else 0.0, weights_ready)
        generated.append(start + t.push_s + t.generation_s)
        trained.append(max(trained[-1] if trained else 0.0, generated[-1]) + t.training_s)
    half = len(sequence) // 2
    return (trained[-1] - trained[half - 1]) / (len(sequence) - half)


@dataclass
class ChooserState:
    """What the chooser remembers between windows: the highest staleness still allowed
    (lowered by a measured KL over the bound), the window measured before the last switch (to
    compare with), the prediction of that switch, and whether exploring is over."""

    ceiling: int
    before_switch: WindowMeasure | None = None
    predicted_s: float | None = None
    done: bool = False


def decide(
    budget: AsynchronyBudget, window: WindowMeasure, state: ChooserState, min_gain: float = 0.05
) -> ScheduleDecision | None:
    """The decision after ``window`` (``None``: nothing to say), updating ``state`` (module
    docstring). Deterministic: it reads nothing but its arguments."""
    k = window.staleness
    bound = budget.max_mismatch_kl
    if bound is not None and k > 0 and not budget.allows(k, window.mismatch_kl):
        state.ceiling = min(state.ceiling, k - 1)
        state.done, state.before_switch = True, None
        return ScheduleDecision(
            window, k - 1, {}, f"mismatch/kl {window.mismatch_kl:.3g} is over the budget's "
            f"{bound:g}; staying at k <= {k - 1} from now on", final=True,
        )  # fmt: skip
    if state.before_switch is not None:  # the window after a switch: keep it or go back
        before, predicted = state.before_switch, state.predicted_s
        state.before_switch, state.predicted_s, state.done = None, None, True
        reference = {k: predicted} if predicted is not None else {}
        if window.period_s < before.period_s:
            reason = (
                f"measured {window.period_s:.2f} s/iteration against {before.period_s:.2f} at "
                f"k={before.staleness} (predicted {predicted:.2f})"
            )
            return ScheduleDecision(window, k, reference, reason, final=True)
        reason = (
            f"measured {window.period_s:.2f} s/iteration, not faster than {before.period_s:.2f} "
            f"at k={before.staleness} (predicted {predicted:.2f}): going back"
        )
        return ScheduleDecision(window, before.staleness, reference, reason, final=True)
    if state.done:
        return None
    state.done = True
    candidates = range(1, min(state.ceiling, budget.max_staleness) + 1)
    if k != 0 or not candidates:
        why = "the budget allows no staleness" if not candidates else "nothing to explore"
        return ScheduleDecision(window, k, {}, why, final=True)
    predicted = {c: predict_period_s(window.iterations, c) for c in candidates}
    fastest = min(predicted.values())
    best = min(c for c, s in predicted.items() if s <= fastest * (1 + TIE_TOLERANCE))
    if window.period_s >= predicted[best] * (1 + min_gain):
        state.before_switch, state.predicted_s, state.done = window, predicted[best], False
        return ScheduleDecision(
            window, best, predicted, f"predicted {window.period_s / predicted[best]:.2f}x "
            "faster", final=False,
        )  # fmt: skip
    reason = f"no staleness is predicted {min_gain:.0%} faster than on-policy"
    return ScheduleDecision(window, k, predicted, reason, final=True)


class ScheduleChooser:
    """Measures windows of iterations and decides (module docstring); rank 0's, in the strategy.

    Args:
        budget: the run's asynchrony budget.
        window: iterations measured per window (after one of warm-up).
        min_gain: the predicted speed-up a switch needs.
        clock: seconds, for the iteration starts (``time.monotonic``).
    """

    def __init__(
        self,
        budget: AsynchronyBudget,
        window: int = 3,
        min_gain: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1:
            raise ValueError(f"the measured window must be >= 1 iteration, got {window}")
        self.budget, self.window, self.min_gain, self.clock = budget, window, min_gain, clock
        self.state = ChooserState(ceiling=budget.max_staleness)
        self.decisions: list[ScheduleDecision] = []
        self._starts: list[float] = []
        self._times: list[IterationTimes] = []
        self._kls: list[float | None] = []
        self._measure_from = 1  # the next window's first iteration (0 warms up)

    def step(
        self, staleness: int, recorder: SpanRecorder, last_kl: float | None
    ) -> ScheduleDecision | None:
        """At an iteration's start, running at ``staleness``; ``last_kl``: the previous
        iteration's ``mismatch/kl``. A decision when a window has just completed."""
        now = self.clock()
        if self._starts:  # the previous iteration ended now
            summary = recorder.summary()
            self._times.append(
                IterationTimes(
                    summary.get("generation_time", 0.0),
                    summary.get("training_time", 0.0),
                    summary.get("push_time", 0.0),
                )
            )
            self._kls.append(last_kl)
        self._starts.append(now)
        done = range(self._measure_from, self._measure_from + self.window)
        if len(self._starts) <= done.stop:
            return None
        kls = [self._kls[i] for i in done if self._kls[i] is not None]
        measure = WindowMeasure(
            staleness,
            (self._starts[done.stop] - self._starts[done.start]) / self.window,
            tuple(self._times[i] for i in done),
            sum(kls) / len(kls) if kls else None,
        )
        decision = decide(self.budget, measure, self.state, self.min_gain)
        # after a switch the iteration starting now warms up the new schedule
        self._measure_from = done.stop + 1 if decision and decision.switch else done.stop
        if decision is not None:
            self.decisions.append(decision)
        return decision
