"""Dynamic sampling (DAPO): train only on groups whose rewards are not all equal, keeping every
rank's count of groups per iteration, with spare prompts generated while the iteration streams.

A group whose rewards are all equal has zero advantages under group baselines: it costs a
forward and backward and teaches nothing. DAPO drops such groups and generates more prompts
until the batch is full again (verl's ``filter_groups``, ``max_num_gen_batches``). Here this
happens *streamed*: the iteration's groups reach the trainer as they finish, and spare prompts
are handed to the rollout workers as soon as a dropped group shows they are needed, while the
rest of the iteration is still being generated.

The rule (what is trained never depends on timing, on which worker finishes first, or on the
number of ranks):

* The iteration has ``T`` original jobs; rank ``r`` owns ``T_r`` of them and trains on exactly
  ``T_r`` groups. Its candidates are the original jobs, then the iteration's spare jobs
  ``s = 0, 1, 2, ...`` (:class:`DynamicSampling.spare`, one sequence per iteration, shared by
  all ranks, so ``N`` ranks train on the same groups as one rank with all ``T`` jobs).
* The iteration trains on the first ``T`` candidates whose rewards are not all equal, in that
  order: every such original (there are at most ``T``), then such spares in spare order until
  there are ``T``. An original group is kept on its own rank and streamed as soon as it is
  scored. Kept spares fill the ranks' shortfalls (``T_r`` minus the rank's kept originals) in
  rank order, then spare order; a kept spare is released once every original and every lower
  spare is scored (its owner is known then).
* Spares are requested as soon as they are needed: after each scored group, enough are
  requested that, were every group still in flight kept, the iteration would be full
  (``missing``), plus ``spares_ahead`` once a group was dropped. With ``spares_ahead=0`` every
  spare generated is needed, so the counts logged do not depend on timing either; a positive
  ``spares_ahead`` trades spares generated for nothing (``spares_unused``) for fewer waits.
* At most ``max_spares`` spares per iteration: if the iteration still is not full then, it fails
  with :class:`DynamicSamplingError` (as verl does when ``max_num_gen_batches`` is reached)
  rather than train on fewer groups, which would change the update's scale silently.

"Rewards all equal" is on the total reward of each completion (after the overlong penalty),
the quantity the advantages are computed from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from periodic_rl.rollout.types import GroupJob, RolloutGroup


class DynamicSamplingError(RuntimeError):
    """The iteration could not be filled with groups whose rewards differ within the bound."""


@dataclass(frozen=True)
class SamplingReport:
    """What dynamic sampling did in one iteration (the same numbers on every rank).

    ``generated``: groups generated and scored (originals and spares); ``zero_std``: those whose
    rewards were all equal (all dropped); ``spares_requested``: spare jobs handed to the
    backend (with ``spares_ahead > 0`` some may have been cancelled in flight);
    ``spares_generated``: spares scored; ``spares_used``: spares trained on; ``spares_unused``:
    spares whose rewards differ but that were not needed (only with ``spares_ahead > 0``).
    """

    groups: int
    generated: int
    zero_std: int
    spares_requested: int
    spares_generated: int
    spares_used: int
    spares_unused: int

    def metrics(self) -> dict[str, float]:
        """Logged as ``dynamic_sampling/<name>`` each iteration."""
        return {
            "dynamic_sampling/zero_std_dropped": float(self.zero_std),
            "dynamic_sampling/frac_zero_std": self.zero_std / max(self.generated, 1),
            "dynamic_sampling/groups_generated": float(self.generated),
            "dynamic_sampling/spares_generated": float(self.spares_generated),
            "dynamic_sampling/spares_used": float(self.spares_used),
            "dynamic_sampling/spares_unused": float(self.spares_unused),
        }


@dataclass
class DynamicSampling:
    """An iteration's request for dynamic sampling (one object per iteration and rank).

    Args:
        spare: ``spare(s)``: the iteration's spare job ``s`` (``s = 0, 1, ...``), a pure
            function of ``s``: its index unique within the iteration (after the originals'),
            its seed derived from that index. Called on rank 0 only, from its rollout thread.
        max_spares: spare jobs allowed per iteration (module docstring).
        spares_ahead: extra spares requested beyond the missing ones once a group was dropped.

    ``report`` is filled on every rank once the iteration's stream has ended normally.
    """

    spare: Callable[[int], GroupJob]
    max_spares: int
    spares_ahead: int = 0
    report: SamplingReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_spares < 0 or self.spares_ahead < 0:
            raise ValueError(
                f"max_spares and spares_ahead must be >= 0, got {self.max_spares} and "
                f"{self.spares_ahead}"
            )


def zero_std(group: RolloutGroup) -> bool:
    """Whether every completion of ``group`` got the same reward (no learning signal)."""
    return not group.rewards or max(group.rewards) == min(group.rewards)


class SpareJobs:
    """The ``spare`` function of :class:`DynamicSampling` for a module: spare ``s`` is the job of
    ``row(s)`` with index ``first_index + s``, remembered so that scoring finds its row.

    Args:
        first_index: the iteration's number of original jobs (spare indices follow them).
        row: ``row(s)``: the data row of spare ``s`` (deterministic: e.g.
            :meth:`~periodic_rl.data.loader.PromptLoader.spare_rows`).
        encode: a row's prompt token ids.
        n: samples per group.
        seed: ``seed(index)``: the group seed of job ``index``.
        job_row: what a job carries of its row (multi-turn rollouts:
            :meth:`~periodic_rl.RLModule.rollout_row`); default none.
    """

    def __init__(
        self,
        first_index: int,
        row: Callable[[int], Any],
        encode: Callable[[Any], list[int]],
        n: int,
        seed: Callable[[int], int],
        job_row: Callable[[Any], dict[str, Any] | None] = lambda row: None,
    ) -> None:
        self.first_index, self._row, self._encode = first_index, row, encode
        self.n, self._seed, self._job_row = n, seed, job_row
        self._made: dict[int, tuple[Any, list[int]]] = {}

    def __call__(self, s: int) -> GroupJob:
        index = self.first_index + s
        if index not in self._made:
            row = self._row(s)
            self._made[index] = (row, self._encode(row))
        row, ids = self._made[index]
        return GroupJob(
            index=index, prompt_ids=ids, n=self.n, seed=self._seed(index), row=self._job_row(row)
        )

    def is_spare(self, index: int) -> bool:
        return index >= self.first_index

    def row(self, index: int) -> tuple[Any, list[int]]:
        """The row and prompt ids of the spare job ``index`` (made by a call before)."""
        return self._made[index]


class DynamicSampler:
    """The keep/drop bookkeeping of one iteration on rank 0 (no threads, no I/O).

    Feed it every scored group (:meth:`add`, which returns the groups released to their ranks);
    after each, hand :meth:`requests` to the backend; the iteration is done when :attr:`full`.
    """

    def __init__(self, jobs: list[GroupJob], owners: list[int], config: DynamicSampling) -> None:
        if len(jobs) != len(owners):
            raise ValueError(f"{len(jobs)} jobs but {len(owners)} owners")
        self.config = config
        self.owner = {job.index: rank for job, rank in zip(jobs, owners, strict=True)}
        self.quota: dict[int, int] = {}
        for rank in owners:
            self.quota[rank] = self.quota.get(rank, 0) + 1
        self.target = len(jobs)
        self.kept: dict[int, int] = dict.fromkeys(self.quota, 0)  # rank -> groups released
        self.originals_left = len(jobs)  # originals not scored yet
        self.spare_index: dict[int, int] = {}  # job index -> spare number s
        self.spares: list[RolloutGroup | None | bool] = []  # s -> None: in flight, False: zero
        self.cursor = 0  # spares before it are decided
        self.spares_kept = 0
        self.nonzero = 0  # scored groups whose rewards differ (originals and spares)
        self.zero = 0
        self.generated = 0
        self.pending = len(jobs)  # requested, not scored yet
        self.dropped_any = False
        self._queue: list[GroupJob] = []

    # ---- the producer's side ------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """Every rank has its count of groups (nothing more is needed this iteration)."""
        return self.originals_left == 0 and self.spares_kept == self.target - self._originals_kept

    def add(self, group: RolloutGroup) -> list[tuple[RolloutGroup, int]]:
        """Record a scored group; return the groups now released, each with its rank."""
        self.generated += 1
        self.pending -= 1
        dropped = zero_std(group)
        if dropped:
            self.zero += 1
            self.dropped_any = True
        else:
            self.nonzero += 1
        released: list[tuple[RolloutGroup, int]] = []
        if group.index in self.owner:
            self.originals_left -= 1
            if not dropped:
                rank = self.owner[group.index]
                self.kept[rank] += 1
                released.append((group, rank))
        elif group.index in self.spare_index:
            s = self.spare_index[group.index]
            if self.spares[s] is not None:
                raise RuntimeError(f"spare group {group.index} was scored twice")
            self.spares[s] = False if dropped else group
        else:
            raise RuntimeError(f"group {group.index} is neither an original nor a spare")
        released += self._release_spares()
        self._plan_spares()
        return released

    def requests(self) -> list[GroupJob]:
        """The spare jobs to hand to the backend now (each once)."""
        out, self._queue = self._queue, []
        return out

    def check_progress(self) -> None:
        """Raise :class:`DynamicSamplingError` when nothing is in flight, the iteration is not
        full and no spare may be requested any more."""
        if self.full or self.pending > 0 or self._queue:
            return
        raise DynamicSamplingError(
            f"dynamic sampling: only {self._originals_kept + self.spares_kept} of the "
            f"iteration's {self.target} groups have rewards that are not all equal after "
            f"{len(self.spares)} spare groups (max_spares={self.config.max_spares}); "
            f"{self.zero} of {self.generated} groups had all-equal rewards. The prompts are "
            "too easy or too hard for the policy (or the reward gives one value): check the "
            "task, or raise the bound"
        )

    def report(self) -> SamplingReport:
        scored_spares = sum(1 for g in self.spares if g is not None)
        used = self.spares_kept
        zero_spares = sum(1 for g in self.spares if g is False)
        return SamplingReport(
            groups=self._originals_kept + used,
            generated=self.generated,
            zero_std=self.zero,
            spares_requested=len(self.spares),
            spares_generated=scored_spares,
            spares_used=used,
            spares_unused=scored_spares - used - zero_spares,
        )

    # ---- internals ----------------------------------------------------------------------------
    @property
    def _originals_kept(self) -> int:
        return sum(self.kept.values()) - self.spares_kept

    def _release_spares(self) -> list[tuple[RolloutGroup, int]]:
        """Decide the spares whose owner is now known: every original and every lower spare
        scored. A spare is kept while the ranks are short of groups."""
        if self.originals_left:
            return []
        released = []
        while self.cursor < len(self.spares) and self.spares[self.cursor] is not None:
            group = self.spares[self.cursor]
            self.cursor += 1
            if group is False or self.full:
                continue
            rank = next(r for r in sorted(self.quota) if self.kept[r] < self.quota[r])
            self.kept[rank] += 1
            self.spares_kept += 1
            released.append((group, rank))
        return released

    def _plan_spares(self) -> None:
        """Request spares so that, if every group in flight is kept, the iteration is full
        (plus ``spares_ahead`` once a group was dropped), within ``max_spares``."""
        if self.full:
            return
        wanted = self.target - self.nonzero
        if wanted <= 0:
            return  # enough groups whose rewards differ are scored; waiting for lower spares
        if self.dropped_any:
            wanted += self.config.spares_ahead
        count = min(wanted - self.pending, self.config.max_spares - len(self.spares))
        for _ in range(max(count, 0)):
            s = len(self.spares)
            job = self.config.spare(s)
            if job.index in self.owner or job.index in self.spare_index:
                raise ValueError(f"spare {s} has index {job.index}, already used this iteration")
            self.spare_index[job.index] = s
            self.spares.append(None)
            self.pending += 1
            self._queue.append(job)
