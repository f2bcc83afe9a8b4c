"""`SplitAdvisor`: when a run has measured its two sides, which hardware split to log or apply.

The strategy asks :meth:`SplitAdvisor.step` at the start of every iteration (rank 0, nothing
generating). Each *window* is ``window`` iterations measured after one of warm-up (the first
iteration of a run, and the first after a switch, start engines and fill caches). After a
window the advisor returns a :class:`SplitStep`: the measured rates, the plan of
:func:`~periodic_rl.cpu_tuning.hardware_split.choose_split` (or, on GPUs, the advice of
:func:`~periodic_rl.cpu_tuning.hardware_split.recommend_gpus`) and, with ``auto``, the split to
switch to before the next iteration:

1. ``auto`` starts taking turns on every core: the synchronous run, so that a run whose
   measurements never predict a gain is exactly as fast as one with overlap off;
2. after the first window the plan (with the efficiencies assumed,
   :data:`~periodic_rl.cpu_tuning.hardware_split.DEFAULT_EFFICIENCY`, or those a cached run
   measured) is applied only if it is predicted faster by ``min_gain`` and, on assumed
   efficiencies, only if the run is long enough to repay a wrong guess
   (:func:`too_short_to_explore`); then the second window,
   on the new split, fits the model (:func:`~periodic_rl.cpu_tuning.hardware_split.fit_model`:
   one window on each core count measures how each side scales), and the final plan is applied
   if it differs from the split running (back to turn-taking when the guess was wrong).

With ``cached`` (a split an earlier run chose, :mod:`~periodic_rl.cpu_tuning.split_cache`), one
window of it is measured and logged, and nothing is explored or switched.

Switching changes no number of the run: overlapped and synchronous iterations compute the same
update, and the moved workers keep the weights they hold.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from periodic_rl.cpu_tuning.hardware_split import (
    DEFAULT_EFFICIENCY,
    Candidate,
    GpuAdvice,
    MeasuredRates,
    SideTime,
    SplitModel,
    SplitPlan,
    choose_split,
    fit_model,
    rates_from_summaries,
    recommend_gpus,
)
from periodic_rl.rollout.timing import SpanRecorder


def starting_split(cores: Sequence[int], num_workers: int, overlap: bool) -> Candidate:
    """Overlapped with the trainer on the first core and the workers on the rest, or (overlap
    off) both sides on every core: the two ends of the candidates."""
    if len(cores) < num_workers + 1:
        raise ValueError(
            f"worker_cores='auto' needs at least num_workers + 1 = {num_workers + 1} cores to "
            f"choose from, this process may use {len(cores)}"
        )
    nothing = MeasuredRates(SideTime(0.0, 1), SideTime(0.0, 1))
    plan = choose_split(nothing, cores, num_workers)  # every candidate, in a fixed order
    return next(c for c in plan.candidates if c.overlap == overlap)


def auto_start(
    num_workers: int,
    use_ray: bool,
    ray_address: str | None,
    gpus_per_worker: float | None,
    max_staleness: int,
    trainer_cores: list[int] | None,
) -> Candidate:
    """The starting split of ``worker_cores: auto`` on this process's cores (turn-taking on all
    of them: the module docstring), or a ValueError naming why the split cannot be applied
    with these options."""
    why = None
    if not use_ray:
        why = "needs rollout workers in Ray actors (use_ray: true)"
    elif ray_address is not None:
        why = "splits this machine's cores; a cluster's workers run elsewhere (ray_address)"
    elif gpus_per_worker:
        why = "splits CPU cores; with GPU workers read the logged split/* advice instead"
    elif max_staleness > 0:
        why = "moves the workers between iterations; max_staleness > 0 generates ahead"
    elif trainer_cores is not None:
        why = "chooses trainer_cores itself: leave trainer_cores unset"
    if why is not None:
        raise ValueError(f"worker_cores='auto' {why}")
    return starting_split(sorted(os.sched_getaffinity(0)), num_workers, overlap=False)


def iterations_left(trainer: Any) -> int | None:
    """The iterations a Lightning ``trainer`` has left, this one included (at a batch's start),
    as far as its limits tell: ``max_steps`` counts optimizer steps (at least one per
    iteration), ``max_epochs`` times the batches of an epoch; ``None`` when neither bounds it."""
    bounds = []
    if (trainer.max_steps or -1) > 0:
        bounds.append(trainer.max_steps - trainer.global_step)
    batches, epochs = trainer.num_training_batches, trainer.max_epochs
    if (epochs or -1) > 0 and isinstance(batches, int):
        bounds.append(epochs * batches - trainer.fit_loop.total_batch_idx)
    return max(0, min(bounds)) if bounds else None


def too_short_to_explore(
    plan: SplitPlan,
    current: Candidate,
    rates: MeasuredRates,
    cores: Sequence[int],
    num_workers: int,
    model: SplitModel,
    iterations_left: int | None,
    window: int,
) -> str | None:
    """Why moving to ``plan.chosen`` on a guess does not pay in this run, or ``None``.

    The guess hopes to gain ``gain`` s per iteration (the plan against the current split) in
    each of the ``iterations_left`` (this one included; ``None``: unbounded). If the sides in
    truth scale linearly (efficiency 1, where spreading each side over every core in turn is
    never beaten), each of the ``1 + window`` iterations spent on the guess (its warm-up and
    the window measured there) loses ``loss`` s instead. A move is worth trying only when
    ``iterations_left * gain >= (1 + window) * loss``: a short run keeps the split it measured.
    """
    if iterations_left is None:
        return None
    linear = replace(model, generation_efficiency=1.0, training_efficiency=1.0)
    worst = choose_split(rates, cores, num_workers, linear)
    worst_s = next(c.predicted_s for c in worst.candidates if c.same_split(plan.chosen))
    kept_s = next(c.predicted_s for c in plan.candidates if c.same_split(current))
    gain, loss = kept_s - plan.chosen.predicted_s, max(0.0, worst_s - kept_s)
    cost = 1 + window
    if iterations_left * gain >= cost * loss:
        return None
    return (
        f"not explored: {iterations_left} iteration(s) left would gain at most "
        f"{iterations_left * gain:.3g} s, a wrong guess would cost up to {cost * loss:.3g} s "
        f"({cost} iterations on it if both sides scale linearly)"
    )


def log_only_advisor(
    overlap: bool,
    worker_cores: list[list[int]] | None,
    lend_idle_cores: bool,
    num_workers: int,
    trainer_cores: list[int] | None,
    machine_cores: list[int],
    window: int,
    model: SplitModel | None = None,
) -> SplitAdvisor:
    """The advisor of a run whose split is fixed: it measures the split running (unpinned
    sides count as running on every core) and logs the advice once.

    ``model``: the knobs a ``worker_cores: auto`` run of the same workload measured (its
    cached choice); without them the parallel efficiencies are assumed, and the advice says
    so, since one window on one split cannot measure them."""
    workers = worker_cores or [machine_cores]
    current = Candidate(
        overlap,
        tuple(trainer_cores or machine_cores),
        tuple(tuple(cores) for cores in workers),
        0.0,
    )
    model = replace(model or SplitModel(), lend_idle_cores=lend_idle_cores)
    return SplitAdvisor(current, machine_cores, num_workers, window, model=model)


@dataclass(frozen=True)
class SplitStep:
    """What one measured window says: its rates, the plan (CPU) or GPU advice, and the split
    to apply before the next iteration (``None``: keep the current one); ``model``: the knobs
    the plan was made with (fitted to the windows so far); ``cached``: the split running came
    from the cache (measured, not explored); ``deferred``: why ``auto`` did not try the plan
    in this run (too few iterations left to repay a wrong guess: nothing is remembered)."""

    rates: MeasuredRates
    plan: SplitPlan | None
    gpus: GpuAdvice | None
    apply: Candidate | None
    final: bool
    model: SplitModel | None = None
    cached: bool = False
    assumed: bool = False
    deferred: str | None = None

    @property
    def reason(self) -> str:
        advice = self.plan.reason if self.plan is not None else None
        advice = advice or (self.gpus.reason if self.gpus is not None else "no advice")
        if self.deferred:
            advice += f"; {self.deferred}"
        if self.assumed:
            advice += (
                f" (parallel efficiency {DEFAULT_EFFICIENCY} per side assumed, not measured: "
                "one run with worker_cores: auto measures it and later runs advise from it)"
            )
        return advice

    def metrics(self, prefix: str = "split/") -> dict[str, float]:
        """Numbers for a logger: the measured rates and the recommended split."""
        g, t = self.rates.generation, self.rates.training
        out = {
            f"{prefix}generation_s": g.busy_s,
            f"{prefix}generation_units": float(g.units),
            f"{prefix}training_s": t.busy_s,
            f"{prefix}training_units": float(t.units),
        }
        if self.plan is not None:
            chosen = self.plan.chosen
            out |= {
                f"{prefix}overlap": float(chosen.overlap),
                f"{prefix}trainer_cores": float(len(chosen.trainer_cores)),
                f"{prefix}worker_cores": float(sum(len(c) for c in chosen.worker_cores)),
                f"{prefix}predicted_s": chosen.predicted_s,
                f"{prefix}applied": float(self.apply is not None),
                f"{prefix}cached": float(self.cached),
                f"{prefix}deferred": float(self.deferred is not None),
            }
        if self.gpus is not None:
            out |= {
                f"{prefix}trainer_gpus": float(self.gpus.trainer_gpus),
                f"{prefix}worker_gpus": float(self.gpus.worker_gpus),
                f"{prefix}predicted_s": self.gpus.predicted_s,
            }
        return out


class SplitAdvisor:
    """Measures windows of iterations from the strategy's spans and advises (module docstring).

    Args:
        current: the split running now (its core counts are the units the rates are measured
            on; with ``auto`` it is also the split applied so far).
        cores: the cores to split (CPU), or ``None`` on GPUs.
        num_workers: rollout workers.
        window: iterations measured per window (after one of warm-up).
        auto: apply the plan (CPU only); else one window is measured and logged.
        gpus: on GPUs, ``(trainer GPUs, GPUs per worker)`` (whole GPUs): the advice is about
            GPUs (``cores`` is then ``None``; with neither, only the rates are reported).
        model: the model's starting knobs (efficiencies assumed until measured).
        cached: ``current`` is a split an earlier run chose: one window is measured and
            logged (``split/cached``), nothing explored or applied (not with ``auto``).
    """

    def __init__(
        self,
        current: Candidate,
        cores: Sequence[int] | None,
        num_workers: int,
        window: int = 3,
        auto: bool = False,
        gpus: tuple[int, int] | None = None,
        model: SplitModel | None = None,
        cached: bool = False,
    ) -> None:
        if window < 1:
            raise ValueError(f"the measured window must be >= 1 iteration, got {window}")
        if auto and cores is None:
            raise ValueError("the split is applied on CPU cores only")
        if cached and auto:
            raise ValueError("a cached split is measured, not explored: auto must be off")
        self.current, self.cores, self.num_workers = current, cores, num_workers
        self.window, self.auto, self.gpus, self.cached = window, auto, gpus, cached
        self.model = model or SplitModel()
        self.windows: list[MeasuredRates] = []
        self.steps: list[SplitStep] = []
        self.done = False
        self._phase_start = 0  # position (in the recorder's iterations) of the warm-up

    def step(self, recorder: SpanRecorder, iterations_left: int | None = None) -> SplitStep | None:
        """At an iteration's start: a :class:`SplitStep` when a window has just completed.
        ``iterations_left``: the run's iterations from this one on (``None``: unbounded)."""
        if self.done:
            return None
        finished = recorder.iterations()
        measured = finished[self._phase_start + 1 :]
        if len(measured) < self.window:
            return None
        summaries = [recorder.summary(i) for i in measured[: self.window]]
        gen_units = sum(len(c) for c in self.current.worker_cores)
        if self.gpus is not None:
            gen_units = self.num_workers * self.gpus[1]
        train_units = self.gpus[0] if self.gpus else len(self.current.trainer_cores)
        rates = rates_from_summaries(summaries, gen_units, train_units, self.current.overlap)
        self.windows.append(rates)
        step = self._advise(rates, len(finished), iterations_left)
        self.steps.append(step)
        return step

    def _advise(
        self, rates: MeasuredRates, position: int, iterations_left: int | None
    ) -> SplitStep:
        if self.cores is None:
            self.done = True
            gpus = None
            if self.gpus is not None:
                gpus = recommend_gpus(rates, gpus_per_worker=self.gpus[1], model=self.model)
            return SplitStep(rates, None, gpus, None, True)
        model = fit_model(self.windows, self.model)
        plan = choose_split(rates, self.cores, self.num_workers, model, self.current)
        assumed = not model.efficiencies_measured  # one core count per side fits none
        if not self.auto:
            self.done = True
            return SplitStep(rates, plan, None, None, True, model, self.cached, assumed)
        # The first window: the plan moves only when predicted faster by min_gain (choose_split
        # keeps the current split otherwise); the second: the fitted model's plan is final.
        apply = None if plan.chosen.same_split(self.current) else plan.chosen
        deferred = None
        if apply is not None and assumed:
            deferred = too_short_to_explore(
                plan, self.current, rates, self.cores, self.num_workers, model,
                iterations_left, self.window,
            )  # fmt: skip
            apply = None if deferred else apply
        self.done = apply is None or len(self.windows) > 1
        if apply is not None:
            self.current, self._phase_start = apply, position
        return SplitStep(
            rates, plan, None, apply, self.done, model, assumed=assumed, deferred=deferred
        )
