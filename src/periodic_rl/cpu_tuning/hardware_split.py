"""Which split of the hardware balances generation and training, from measured busy times.

After a few iterations a run knows how long its workers were busy generating and how long its
trainer was busy training, each on a known number of cores (or GPUs). This module turns those
two numbers into the split that should make an iteration shortest. It is pure: the same
measurements give the same plan, so the choice can be tested and logged before it is applied.

The model, per iteration:

- *work scales with cores*: a side busy ``b`` seconds on ``m`` cores takes
  ``b * s(m) / s(n)`` on ``n`` cores, with the speedup ``s(n) = 1 + e * (n - 1)`` and ``e``
  the parallel efficiency (1: time x cores is constant);
- *overlap on disjoint cores* (trainer ``k`` cores, workers the other ``C - k``): the two sides
  run at once as a two-stage pipeline of the iteration's ``M`` micro-batches
  (:func:`pipeline_s`): the trainer starts once the first micro-batch is generated and trains
  the last one after generation ends, so an iteration takes between ``max(generation,
  training)`` (many micro-batches) and ``generation + training`` (one); with the trainer
  borrowing the workers' idle cores (``lend_idle_cores``), what is left of training once
  generation ends runs on every core. A measured overlapped window adds its residual as a
  fixed cost;
- *turn-taking on all cores* (overlap off): generation on all ``C`` cores, then training on all
  ``C`` cores: ``generation + training``;
- what neither side does in parallel with the other (the weight push) adds to both alike.

:func:`fit_model` measures the efficiencies, the serial time and the cost of overlapping from
one window of iterations run each way (the same numbers either way: overlap never changes the
update), so that the model then reproduces both measured iteration times.

On a cluster the GPUs are not re-split inside a run: :func:`recommend_gpus` says how many
worker GPUs would balance the measured trainer, for the next launch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

#: The parallel efficiency assumed until measured on two core counts: a middle guess (small
#: models on a few CPU cores scale far from linearly; one core more may not help at all).
DEFAULT_EFFICIENCY = 0.5


def speedup(units: int, efficiency: float) -> float:
    """``s(n) = 1 + e (n - 1)``: how much faster a side runs on ``units`` than on one."""
    return 1.0 + efficiency * (units - 1)


@dataclass(frozen=True)
class SideTime:
    """Seconds one side (generation or training) was busy per iteration, on ``units`` cores or
    GPUs."""

    busy_s: float
    units: int

    def __post_init__(self) -> None:
        if not (isinstance(self.busy_s, int | float) and 0 <= self.busy_s < math.inf):
            raise ValueError(f"busy time must be >= 0 finite seconds, got {self.busy_s!r}")
        if isinstance(self.units, bool) or not isinstance(self.units, int) or self.units < 1:
            raise ValueError(f"a side runs on >= 1 core or GPU, got {self.units!r}")

    def on(self, units: int, efficiency: float = 1.0) -> float:
        """The busy time predicted on ``units`` cores (or GPUs)."""
        return self.busy_s * speedup(self.units, efficiency) / speedup(units, efficiency)


@dataclass(frozen=True)
class MeasuredRates:
    """One iteration's busy times, averaged over ``iterations`` measured iterations.

    ``serial_s``: time on neither side's busy clock (the weight push); ``wall_s``: the mean
    iteration; ``overlap``: whether the two sides overlapped while measured (``None``: unknown);
    ``micro_batches``: micro-batches trained per iteration (``None``: not measured, the sides
    are taken to overlap fully); ``lent_s``: of training's busy time, the seconds it ran on the
    workers' idle cores too (every core), which :meth:`training_on` takes out.
    """

    generation: SideTime
    training: SideTime
    serial_s: float = 0.0
    wall_s: float | None = None
    overlap: bool | None = None
    iterations: int = 1
    micro_batches: float | None = None
    lent_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("serial_s", "wall_s", "lent_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        if self.iterations < 1:
            raise ValueError(f"rates need >= 1 measured iteration, got {self.iterations}")
        if self.micro_batches is not None and not self.micro_batches >= 1:
            raise ValueError(f"an iteration trains >= 1 micro-batch, got {self.micro_batches!r}")

    def training_on(self, units: int, efficiency: float, all_units: int) -> float:
        """Training's busy time predicted on ``units`` of ``all_units`` cores, none borrowed.

        Busy ``B`` s on ``k`` cores of which ``L`` s on all ``n`` (borrowed): the work done on
        ``k`` cores took ``B - L`` s, ``r = s(n) / s(k)`` times what it takes on ``n``; so
        training alone on ``n`` cores takes ``(B - L) / r + L``."""
        t = self.training
        if self.lent_s <= 0 or t.units >= all_units:
            return t.on(units, efficiency)
        ratio = speedup(all_units, efficiency) / speedup(t.units, efficiency)
        on_all = (max(0.0, t.busy_s - self.lent_s)) / ratio + min(self.lent_s, t.busy_s)
        return SideTime(on_all, all_units).on(units, efficiency)


def pipeline_s(
    generation_s: float,
    training_s: float,
    micro_batches: float | None,
    training_after_s: float | None = None,
) -> float:
    """An overlapped iteration's wall, generation and training as a two-stage pipeline.

    The iteration's work is cut into ``micro_batches`` equal micro-batches (rounded; ``None``:
    so many that the sides overlap fully, ``max(generation, training)``). Micro-batch ``i`` is
    generated by ``(i + 1) / M`` of ``generation_s``; its training starts then or when the
    previous one is trained, and takes ``training_s / M``, or, once generation has ended,
    ``training_after_s / M`` (the trainer on the workers' idle cores too; default: no faster).
    """
    if micro_batches is None:
        return max(generation_s, training_s)
    count = max(1, round(micro_batches))
    each_gen, each_train = generation_s / count, training_s / count
    each_after = (training_after_s if training_after_s is not None else training_s) / count
    clock = 0.0
    for i in range(count):
        start = max(clock, (i + 1) * each_gen)
        before_end = max(0.0, generation_s - start)  # time this one trains beside generation
        if each_train <= before_end:
            clock = start + each_train
        else:  # the rest of it after generation ends, at the faster pace
            left = 1.0 - before_end / each_train if each_train > 0 else 0.0
            clock = start + before_end + left * each_after
    return clock


@dataclass(frozen=True)
class SplitModel:
    """The model's knobs (module docstring): the parallel efficiency of each side (0: more
    cores do not help, 1: time x cores is constant; :func:`fit_model` measures them, and
    ``efficiencies_measured`` says it did), the cost of overlapping beyond the pipeline's
    fill and drain (measured), the serial time per iteration (``None``: the rates'
    ``serial_s``), ``min_gain``: the current split is kept unless another is predicted faster
    by this fraction (a switch moves the workers, and a wrong guess costs a window on the
    slower split), and ``lend_idle_cores``: whether an overlapped trainer borrows the workers'
    cores once generation ends (the run's option of that name)."""

    generation_efficiency: float = DEFAULT_EFFICIENCY
    training_efficiency: float = DEFAULT_EFFICIENCY
    overlap_cost_s: float = 0.0
    serial_s: float | None = None
    min_gain: float = 0.05
    efficiencies_measured: bool = False
    lend_idle_cores: bool = False

    def __post_init__(self) -> None:
        for name in ("generation_efficiency", "training_efficiency"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.overlap_cost_s >= 0 or not self.min_gain >= 0:
            raise ValueError("overlap_cost_s and min_gain must be >= 0")
        if self.serial_s is not None and not self.serial_s >= 0:
            raise ValueError(f"serial_s must be >= 0, got {self.serial_s}")


def efficiency_between(a: SideTime, b: SideTime) -> float | None:
    """The efficiency ``e`` that explains one side's busy times on two core counts, clipped to
    [0, 1] (``None`` when both ran on as many cores: nothing to learn)."""
    if a.units == b.units or a.busy_s <= 0 or b.busy_s <= 0:
        return None
    ratio = a.busy_s / b.busy_s  # = s(b.units) / s(a.units)
    denominator = (b.units - 1) - ratio * (a.units - 1)
    if denominator == 0:
        return 1.0
    return min(1.0, max(0.0, (ratio - 1) / denominator))


def overlapped_s(
    rates: MeasuredRates, model: SplitModel, trainer_units: int, worker_units: int
) -> float:
    """The busy part of an overlapped iteration, trainer on ``trainer_units`` and workers on
    the other ``worker_units`` (:func:`pipeline_s`; the serial time and overlap cost apart)."""
    ge, te = model.generation_efficiency, model.training_efficiency
    every = trainer_units + worker_units
    after = rates.training_on(every, te, every) if model.lend_idle_cores else None
    return pipeline_s(
        rates.generation.on(worker_units, ge),
        rates.training_on(trainer_units, te, every),
        rates.micro_batches,
        after,
    )


def fit_model(windows: Sequence[MeasuredRates], base: SplitModel | None = None) -> SplitModel:
    """``base`` with what measured windows tell: the efficiencies (an overlapped window and a
    turn-taking one, on different core counts; training's borrowed seconds taken out), the
    serial time (a turn-taking window's wall minus both sides) and the overlap cost (an
    overlapped window's wall minus its pipeline, :func:`overlapped_s`, and the serial time).
    Without such windows, ``base``'s values stay."""
    model = base or SplitModel()
    overlapped = next((w for w in windows if w.overlap and w.wall_s is not None), None)
    turns = next((w for w in windows if w.overlap is False and w.wall_s is not None), None)
    changes: dict[str, float | bool] = {}
    if turns is not None:
        busy = turns.generation.busy_s + turns.training.busy_s
        changes["serial_s"] = max(0.0, turns.wall_s - busy)
    if overlapped is not None and turns is not None:
        alone = (
            ("generation", overlapped.generation, turns.generation),
            ("training", _training_alone(overlapped, turns), turns.training),
        )
        for side, measured, on_all in alone:
            e = efficiency_between(measured, on_all) if measured is not None else None
            if e is not None:
                changes[f"{side}_efficiency"] = e
                changes["efficiencies_measured"] = True
    if overlapped is not None:
        fitted = replace(model, **changes)
        serial = changes.get("serial_s", overlapped.serial_s)
        g, t = overlapped.generation, overlapped.training
        busy = overlapped_s(overlapped, fitted, t.units, g.units)
        changes["overlap_cost_s"] = max(0.0, overlapped.wall_s - busy - serial)
    return replace(model, **changes)


def _training_alone(overlapped: MeasuredRates, turns: MeasuredRates) -> SideTime | None:
    """The overlapped window's training as if none of it had borrowed cores: the share of the
    work done on borrowed cores is its seconds over the turn-taking window's training (both on
    every core). ``None`` when the loans did it all (nothing left to tell the trainer's own
    cores apart)."""
    t, lent = overlapped.training, overlapped.lent_s
    if lent <= 0 or turns.training.units <= t.units:
        return t
    own_share = 1.0 - lent / turns.training.busy_s if turns.training.busy_s > 0 else 0.0
    if own_share <= 0:
        return None
    return SideTime(max(0.0, t.busy_s - lent) / own_share, t.units)


@dataclass(frozen=True)
class Candidate:
    """One way to use the cores: ``overlap`` on (disjoint trainer and worker cores) or off
    (turn-taking: both sides on every core), and its predicted seconds per iteration."""

    overlap: bool
    trainer_cores: tuple[int, ...]
    worker_cores: tuple[tuple[int, ...], ...]
    predicted_s: float

    @property
    def label(self) -> str:
        if not self.overlap:
            return f"turn-taking on all {len(self.trainer_cores)} cores"
        workers = sum(len(c) for c in self.worker_cores)
        return f"overlap, trainer {len(self.trainer_cores)} core(s), workers {workers}"

    def same_split(self, other: Candidate) -> bool:
        """Whether both put the same cores to the same use (predictions aside)."""
        key = (self.overlap, self.trainer_cores, self.worker_cores)
        return key == (other.overlap, other.trainer_cores, other.worker_cores)


@dataclass(frozen=True)
class SplitPlan:
    """The chosen split, every candidate (in the tie-break order) and why."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    rates: MeasuredRates
    reason: str


def _partition(cores: Sequence[int], parts: int) -> tuple[tuple[int, ...], ...]:
    """``cores`` cut into ``parts`` contiguous runs, sizes differing by at most one (the
    first runs are the larger)."""
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(cores[start:end]))
        start = end
    return tuple(out)


def choose_split(
    rates: MeasuredRates,
    cores: Sequence[int],
    num_workers: int = 1,
    model: SplitModel | None = None,
    current: Candidate | None = None,
) -> SplitPlan:
    """The split of ``cores`` (this machine's core ids) predicted to make an iteration shortest.

    Candidates, in the order that breaks ties: turn-taking (trainer on every core, each worker
    on its share of them), then overlap with the trainer on the first 1, 2, ... cores and the
    workers on the rest (each worker at least one core). With ``current`` (the split the rates
    were measured on), it is kept unless the best is faster by ``model.min_gain``.
    """
    model = model or SplitModel()
    cores = tuple(int(c) for c in cores)
    if len(set(cores)) != len(cores) or any(c < 0 for c in cores):
        raise ValueError(f"cores must be distinct core ids >= 0, got {list(cores)}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if len(cores) < num_workers:
        raise ValueError(f"{len(cores)} core(s) cannot hold {num_workers} workers (one each)")
    gen, train = rates.generation, rates.training
    ge, te = model.generation_efficiency, model.training_efficiency
    serial = model.serial_s if model.serial_s is not None else rates.serial_s
    n = len(cores)
    turns = gen.on(n, ge) + rates.training_on(n, te, n) + serial
    candidates = [Candidate(False, cores, _partition(cores, num_workers), turns)]
    for k in range(1, n - num_workers + 1):
        predicted = overlapped_s(rates, model, k, n - k) + model.overlap_cost_s + serial
        candidates.append(Candidate(True, cores[:k], _partition(cores[k:], num_workers), predicted))
    best = min(candidates, key=lambda c: c.predicted_s)  # min keeps the first of equals
    kept = next((c for c in candidates if current is not None and c.same_split(current)), None)
    others = "; ".join(f"{c.label}: {c.predicted_s:.3g} s" for c in candidates if c is not best)
    measured = (
        f"generation {gen.busy_s:.3g} s on {gen.units}, training {train.busy_s:.3g} s on "
        f"{train.units} per iteration"
    )
    if kept is not None and kept.predicted_s <= best.predicted_s * (1 + model.min_gain):
        chosen = kept
        reason = (
            f"kept {kept.label} ({kept.predicted_s:.3g} s/iteration predicted): the best, "
            f"{best.label} ({best.predicted_s:.3g} s), gains less than {model.min_gain:.0%}; "
            f"{measured}"
        )
    else:
        chosen = best
        reason = (
            f"{best.label}: {best.predicted_s:.3g} s/iteration predicted ({measured}); "
            f"others: {others or 'none'}"
        )
    return SplitPlan(chosen, tuple(candidates), rates, reason)


@dataclass(frozen=True)
class GpuAdvice:
    """The GPUs that would balance the two sides (for the next launch; nothing is applied)."""

    trainer_gpus: int
    worker_gpus: int
    num_workers: int
    predicted_s: float
    measured_s: float
    reason: str


def recommend_gpus(
    rates: MeasuredRates,
    total_gpus: int | None = None,
    gpus_per_worker: int = 1,
    model: SplitModel | None = None,
) -> GpuAdvice:
    """How many of ``total_gpus`` (default: those measured, trainer's + workers') should go to
    workers of ``gpus_per_worker`` GPUs each, so that overlapped generation and training take
    about as long. Ties go to fewer workers (the trainer keeps more)."""
    model = model or SplitModel()
    gen, train = rates.generation, rates.training
    ge, te = model.generation_efficiency, model.training_efficiency
    serial = model.serial_s if model.serial_s is not None else rates.serial_s
    total = gen.units + train.units if total_gpus is None else total_gpus
    if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, int):
        raise ValueError(f"gpus_per_worker must be a whole number, got {gpus_per_worker!r}")
    if gpus_per_worker < 1 or total < gpus_per_worker + 1:
        raise ValueError(
            f"{total} GPU(s) cannot hold a trainer and a worker of {gpus_per_worker} GPU(s)"
        )

    def predicted(workers: int) -> float:
        w = workers * gpus_per_worker
        busy = pipeline_s(gen.on(w, ge), train.on(total - w, te), rates.micro_batches)
        return busy + model.overlap_cost_s + serial

    options = range(1, (total - 1) // gpus_per_worker + 1)
    workers = min(options, key=predicted)
    measured = rates.wall_s
    if measured is None:
        measured = max(gen.busy_s, train.busy_s) + model.overlap_cost_s + serial
    w = workers * gpus_per_worker
    reason = (
        f"{total - w} trainer GPU(s), {workers} worker(s) of {gpus_per_worker}: "
        f"{predicted(workers):.3g} s/iteration predicted, {measured:.3g} s measured on "
        f"{train.units} + {gen.units}"
    )
    return GpuAdvice(total - w, w, workers, predicted(workers), measured, reason)


def rates_from_summaries(
    summaries: Sequence[Mapping[str, float]],
    generation_units: int,
    training_units: int,
    overlap: bool | None = None,
) -> MeasuredRates:
    """The mean busy times of iteration summaries (:meth:`~periodic_rl.rollout.timing.
    SpanRecorder.summary`: ``generation_time``, ``training_time``, ``push_time``,
    ``wall_time``, and where present ``micro_batches`` and ``training_lent_time``), measured on
    that many cores or GPUs per side, overlapped or not."""
    if not summaries:
        raise ValueError("no iteration summaries to measure rates from")

    def mean(key: str) -> float:
        return sum(float(s[key]) for s in summaries) / len(summaries)

    def mean_if_counted(key: str) -> float | None:  # keys older summaries lack
        return mean(key) if all(key in s for s in summaries) else None

    micro_batches = mean_if_counted("micro_batches")
    return MeasuredRates(
        SideTime(mean("generation_time"), generation_units),
        SideTime(mean("training_time"), training_units),
        serial_s=mean("push_time"),
        wall_s=mean("wall_time"),
        overlap=overlap,
        iterations=len(summaries),
        micro_batches=micro_batches if micro_batches is not None and micro_batches >= 1 else None,
        lent_s=mean_if_counted("training_lent_time") or 0.0,
    )
