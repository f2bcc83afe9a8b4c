"""One iteration's rollouts on rank 0: generate, score, and route each group to its rank.

:func:`produce` runs on rank 0 in the pipeline's thread
(:class:`~periodic_rl.rollout.pipeline.RolloutPipeline`): it asks the backend for every group of
the iteration (all ranks' prompts), scores each group as it finishes, and hands it to the rank
that owns it: its own groups go into the local :class:`GroupStream`, the others' are sent over
the :class:`RankLink` (every other rank's pipeline thread files them). Each rank's stream ends
with an :class:`EndOfIteration` (carrying the producer's error, if any), so no rank waits for
groups that will never come.

With dynamic sampling (``IterationPlan.dynamic``, :mod:`periodic_rl.rollout.dynamic_sampling`)
:func:`produce` drops the groups whose rewards are all equal, hands spare jobs to the backend
while it generates (a :class:`~periodic_rl.rollout.backend.JobSource`), and sends every rank the
iteration's :class:`~periodic_rl.rollout.dynamic_sampling.SamplingReport` with its
:class:`EndOfIteration` (rank 0's own goes to ``stream.summary``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from periodic_rl.rollout.backend import GroupGenerator, JobSource
from periodic_rl.rollout.dynamic_sampling import DynamicSampler, DynamicSampling
from periodic_rl.rollout.ranks import RankLink
from periodic_rl.rollout.stream import GroupStream
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

ScoreFn = Callable[[GeneratedGroup], RolloutGroup]
AllScoredFn = Callable[[list[RolloutGroup]], None]


@dataclass(frozen=True)
class EndOfIteration:
    """The last item rank 0 sends a rank in an iteration; ``error`` when generation failed;
    ``summary``: what the producer reports about the iteration (dynamic sampling's report)."""

    error: str | None = None
    summary: Any = None


class RemoteRolloutError(RuntimeError):
    """Rank 0's rollout thread failed; this rank stops its iteration too."""


@dataclass(frozen=True)
class IterationPlan:
    """What one iteration generates: every rank's jobs, who owns each, and how."""

    jobs: list[GroupJob]
    owners: list[int]  # owners[i]: the rank that trains on jobs[i]'s group
    sampling: SamplingConfig
    version: int
    ramp_groups: int | None  # groups of a micro-batch when overlapped (first and last calls)
    dynamic: DynamicSampling | None = None  # drop all-equal-reward groups, fill with spares
    groups_per_call: int | None = None  # None: the backend's own


def produce(
    backend: GroupGenerator,
    plan: IterationPlan,
    score: ScoreFn,
    stream: GroupStream,
    link: RankLink,
    on_all_scored: AllScoredFn | None = None,
) -> None:
    """Generate, score and route the iteration's groups (rank 0's rollout thread).

    Stops early, dropping the calls in flight, once the local consumer cancels ``stream``.
    Every other rank gets an :class:`EndOfIteration` however this ends.
    """
    owner = {job.index: rank for job, rank in zip(plan.jobs, plan.owners, strict=True)}
    remote = sorted(set(plan.owners) - {0})
    error: str | None = None
    summary: Any = None
    try:
        if plan.dynamic is not None:
            summary = _produce_dynamic(backend, plan, score, stream, link, on_all_scored)
            if summary is None:
                error = "rank 0 stopped its iteration"
            return
        held: list[RolloutGroup] = []
        calls = backend.generate(
            plan.jobs,
            plan.sampling,
            plan.version,
            groups_per_call=plan.groups_per_call,
            ramp_groups=plan.ramp_groups,
            cancel=stream.cancel_event,
        )
        received: set[int] = set()
        with closing(calls):  # leaving early drops the calls still in flight
            for generated in calls:
                if stream.cancelled:
                    break
                if generated.index in received or generated.index not in owner:
                    raise RuntimeError(
                        f"the backend returned group {generated.index} "
                        f"{'twice' if generated.index in received else 'not asked for'}"
                    )
                received.add(generated.index)
                group = score(generated)
                if on_all_scored is None:
                    _route(group, owner[group.index], stream, link)
                else:
                    held.append(group)
        if stream.cancelled:
            error = "rank 0 stopped its iteration"
            return
        if len(received) != len(owner):  # never train on fewer groups than planned, silently
            missing = sorted(owner.keys() - received)
            raise RuntimeError(
                f"the backend ended the iteration with {len(missing)} of its {len(owner)} "
                f"groups not generated (jobs {missing[:10]})"
            )
        if on_all_scored is not None:  # advantages that need every reward of the iteration
            on_all_scored(held)
            for group in held:
                _route(group, owner[group.index], stream, link)
        stream.close()
    except BaseException as exc:  # re-raised in the trainer's thread
        error = f"{type(exc).__name__}: {exc}"
        stream.error(exc)
    finally:
        for rank in remote:
            link.send(rank, EndOfIteration(error, summary))


def _produce_dynamic(
    backend: GroupGenerator,
    plan: IterationPlan,
    score: ScoreFn,
    stream: GroupStream,
    link: RankLink,
    on_all_scored: AllScoredFn | None,
) -> Any:
    """:func:`produce` with dynamic sampling: returns the iteration's report (None when the
    local consumer cancelled), having closed ``stream``; raises when it cannot be filled."""
    sampler = DynamicSampler(plan.jobs, plan.owners, plan.dynamic)
    source = JobSource()
    held: list[tuple[RolloutGroup, int]] = []
    try:
        calls = backend.generate(
            plan.jobs,
            plan.sampling,
            plan.version,
            groups_per_call=plan.groups_per_call,
            ramp_groups=plan.ramp_groups,
            cancel=stream.cancel_event,
            more_jobs=source,
        )
        with closing(calls):  # leaving early (full) drops the surplus spares still in flight
            sampler.check_progress()
            for generated in calls:
                if stream.cancelled:
                    break
                for group, rank in sampler.add(score(generated)):
                    if on_all_scored is None:
                        _route(group, rank, stream, link)
                    else:
                        held.append((group, rank))
                source.put(sampler.requests())
                if sampler.full:
                    break
                sampler.check_progress()
    finally:
        source.close()
    if stream.cancelled:
        return None
    if not sampler.full:
        raise RuntimeError(
            f"the backend ended the iteration with {sampler.pending} of its groups not generated"
        )
    if on_all_scored is not None:  # over the groups kept
        on_all_scored([group for group, _ in held])
        for group, rank in held:
            _route(group, rank, stream, link)
    report = sampler.report()
    stream.summary = report
    stream.close()
    return report


def _route(group: RolloutGroup, rank: int, stream: GroupStream, link: RankLink) -> None:
    if rank == 0:
        stream.put(group)
    else:
        link.send(rank, group)
