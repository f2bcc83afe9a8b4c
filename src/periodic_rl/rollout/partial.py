"""`PartialRollouts`: completions that continue under newer weights while they are generated.

With bounded staleness (``k >= 1``) iteration ``j`` starts generating with the weights of version
``v = j - k``. Its long completions would otherwise be sampled to their last token by weights that
are older still when the iteration is trained. With ``partial_rollout_tokens: C``, the iteration
is generated in chunks of ``C`` tokens. Chunk ``c`` of every completion still running is sampled
by version ``min(v + c, j)`` (:meth:`~periodic_rl.rollout.schedule.RolloutSchedule.
chunk_versions`): the weights are updated in flight, and the completion continues from its own
token ids (never re-tokenized) under the newer weights. The chunk versions are fixed by the
schedule, so the run still does not depend on which side was faster. A chunk waits for its
version if the trainer has not published it yet.

Every token carries the version that sampled it (``GeneratedGroup.token_versions``) and its
behaviour log-prob under that version. The loss's importance correction is therefore each
token's own: ``min(exp(logp_trainer - logp_behaviour), cap)`` with the behaviour log-prob of the
weights that drew the token. The trainer checks every version a group's tokens carry against the
fingerprints the engines confirmed (:func:`~periodic_rl.on_policy.check_on_policy`). With
``k = 0`` the chunk versions are all ``j``: a completion never spans an update.

Sample ``i`` of a group continues, chunk after chunk, as a one-sample job whose seed is derived
from the group's seed, ``i`` and the chunk (:func:`continuation_seed`), so the result does not
depend on which other requests share an engine batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from periodic_rl.rollout.backend import JobSource, RolloutBackend
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig

#: Makes the engines hold a version (pushing its snapshot if needed); returns nothing.
EnsureVersion = Callable[[int], None]


def continuation_seed(seed: int, sample: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` (>= 1) of sample ``sample`` of a group with base ``seed``."""
    return (seed * 1_000_003 + sample * 9_973 + chunk * 7_919) % (2**31 - 1)


@dataclass
class _Sample:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class _Group:
    job: GroupJob
    samples: list[_Sample]
    fingerprints: dict[int, str] = field(default_factory=dict)
    logprobs: bool = True  # every chunk came with behaviour log-probs
    worker: int = 0
    started: float = 0.0
    finished: float = 0.0


class PartialRollouts:
    """A backend's :meth:`generate` in chunks whose versions the schedule names (module
    docstring); everything else is the wrapped backend's."""

    def __init__(
        self,
        backend: RolloutBackend,
        chunk_tokens: int,
        versions: Sequence[int],
        ensure_version: EnsureVersion,
        eos_token_ids: Sequence[int],
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"partial_rollout_tokens must be >= 1, got {chunk_tokens}")
        self.backend, self.chunk_tokens = backend, chunk_tokens
        self.versions, self.ensure_version = list(versions), ensure_version
        self.eos = frozenset(eos_token_ids)

    def generate(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        version: int,
        groups_per_call: int | None = None,
        ramp_groups: int | None = None,
        cancel: threading.Event | None = None,
        more_jobs: JobSource | None = None,
    ) -> Iterator[GeneratedGroup]:
        """Every job once, generated chunk by chunk; a group is yielded once all its samples
        ended (an end token, or ``sampling.max_new_tokens`` in all). Jobs added meanwhile
        (``more_jobs``, dynamic sampling) are not generated in chunks: refused."""
        if more_jobs is not None:
            raise ValueError("partial rollouts do not generate jobs added mid-iteration")
        if version != self.versions[0]:
            raise ValueError(
                f"asked for version {version}, the first chunk's is {self.versions[0]}"
            )
        groups = {job.index: _Group(job, [_Sample() for _ in range(job.n)]) for job in jobs}
        total, chunk = sampling.max_new_tokens, 0
        while any(not s.done for g in groups.values() for s in g.samples):
            if cancel is not None and cancel.is_set():
                return
            budget = min(self.chunk_tokens, total - chunk * self.chunk_tokens)
            chunk_version = self.versions[min(chunk, len(self.versions) - 1)]
            if chunk > 0:
                self.ensure_version(chunk_version)
            requests, owners = self._requests(groups, chunk)
            calls = self.backend.generate(
                requests, replace(sampling, max_new_tokens=budget), chunk_version,
                groups_per_call, ramp_groups, cancel,
            )  # fmt: skip
            yield from self._collect(calls, groups, owners, budget, total)
            chunk += 1

    def _requests(
        self, groups: dict[int, _Group], chunk: int
    ) -> tuple[list[GroupJob], dict[int, tuple[int, int | None]]]:
        """The chunk's jobs, and for each the group and sample it continues (``None``: the
        first chunk, every sample of the group)."""
        if chunk == 0:
            return [g.job for g in groups.values()], {i: (i, None) for i in groups}
        requests, owners = [], {}
        for index, group in groups.items():
            for i, sample in enumerate(group.samples):
                if not sample.done:
                    job = GroupJob(
                        index=len(requests),
                        prompt_ids=list(group.job.prompt_ids) + sample.ids,
                        n=1,
                        seed=continuation_seed(group.job.seed, i, chunk),
                    )
                    owners[job.index] = (index, i)
                    requests.append(job)
        return requests, owners

    def _collect(
        self,
        calls: Iterator[GeneratedGroup],
        groups: dict[int, _Group],
        owners: dict[int, tuple[int, int | None]],
        budget: int,
        total: int,
    ) -> Iterator[GeneratedGroup]:
        """Append one chunk's tokens (at most ``budget`` each, ``total`` in all) to the samples
        they continue; yield each group whose samples have all ended."""
        for generated in calls:
            index, only = owners[generated.index]
            group = groups[index]
            group.fingerprints[generated.version] = generated.fingerprint
            group.worker = generated.worker
            group.started = group.started or generated.started
            group.finished = generated.finished
            group.logprobs = group.logprobs and bool(generated.logprobs)
            which = range(group.job.n) if only is None else [only]
            for row, i in enumerate(which):
                sample, ids = group.samples[i], generated.completion_ids[row]
                logprobs = generated.logprobs[row] if generated.logprobs else []
                sample.ids += ids
                sample.logprobs += logprobs
                sample.versions += [generated.version] * len(ids)
                ended = len(ids) < budget or (ids and ids[-1] in self.eos)
                sample.done = bool(ended) or len(sample.ids) >= total
            if all(s.done for s in group.samples):
                yield self._finished(group)

    @staticmethod
    def _finished(group: _Group) -> GeneratedGroup:
        first = min(group.fingerprints)
        return GeneratedGroup(
            index=group.job.index,
            completion_ids=[s.ids for s in group.samples],
            version=first,
            fingerprint=group.fingerprints[first],
            worker=group.worker,
            seed=group.job.seed,
            started=group.started,
            finished=group.finished,
            logprobs=[s.logprobs for s in group.samples] if group.logprobs else [],
            token_versions=[s.versions for s in group.samples],
            version_fingerprints=dict(group.fingerprints),
        )
