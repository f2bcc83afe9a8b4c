"""Partial rollouts: a completion generated in chunks, each chunk by the version the schedule
names, continued from its own token ids, every token tagged with the version that drew it."""

from __future__ import annotations

import pytest

from periodic_rl.rollout.partial import PartialRollouts, continuation_seed
from periodic_rl.rollout.pipeline import RolloutSchedule
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig

EOS = 2


class ScriptedLengths:
    """A backend for prompts ``[lengths]``: sample ``i`` writes token ``100 + i`` until it has
    ``lengths[i]`` tokens in all, the last one EOS; a continuation (one sample, the prompt
    followed by its tokens) reads ``i`` from its first token. Log-prob ``-version`` per token.
    Records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[GroupJob], int]] = []

    def generate(
        self, jobs, sampling, version, groups_per_call=None, ramp_groups=None, cancel=None
    ):
        self.calls.append((version, list(jobs), sampling.max_new_tokens))
        for job in jobs:
            lengths, so_far = job.prompt_ids[0], job.prompt_ids[1:]
            samples = range(job.n) if not so_far else [so_far[0] - 100]
            rows = []
            for i in samples:
                room = min(sampling.max_new_tokens, lengths[i] - len(so_far))
                ended = len(so_far) + room == lengths[i]
                rows.append([100 + i] * (room - ended) + [EOS] * ended)
            yield GeneratedGroup(
                index=job.index, completion_ids=rows, version=version,
                fingerprint=f"fp{version}", worker=0, seed=job.seed,
                logprobs=[[-float(version)] * len(r) for r in rows],
            )  # fmt: skip


def test_each_chunk_is_drawn_by_its_version_and_each_token_tagged_with_it():
    backend, pushed = ScriptedLengths(), []
    partial = PartialRollouts(backend, 3, [4, 5, 5], pushed.append, [EOS])
    job = GroupJob(index=7, prompt_ids=[(2, 9, 5)], n=3, seed=11)
    (group,) = list(partial.generate([job], SamplingConfig(max_new_tokens=8), 4))
    assert [len(c) for c in group.completion_ids] == [2, 8, 5]
    assert group.token_versions == [[4, 4], [4, 4, 4, 5, 5, 5, 5, 5], [4, 4, 4, 5, 5]]
    assert group.logprobs == [[-float(v) for v in row] for row in group.token_versions]
    assert group.completion_ids[0][-1] == EOS and group.completion_ids[2][-1] == EOS
    assert EOS not in group.completion_ids[1]  # cut at max_new_tokens, as without chunks
    assert (group.index, group.version, group.fingerprint) == (7, 4, "fp4")
    assert group.version_fingerprints == {4: "fp4", 5: "fp5"}
    assert pushed == [5, 5]  # the engines hold each later chunk's version before it runs
    assert [(v, len(jobs), cap) for v, jobs, cap in backend.calls] == [
        (4, 1, 3),  # the group, every sample
        (5, 2, 3),  # the samples still running: 1 and 2 (0 ended with EOS)
        (5, 1, 2),  # sample 1 alone, for the 2 tokens left of 8
    ]
    continued = backend.calls[1][1][0]
    assert continued.n == 1 and continued.seed == continuation_seed(11, 1, 1)
    assert continued.prompt_ids == [(2, 9, 5), *group.completion_ids[1][:3]]  # its own ids


def test_a_group_whose_samples_all_end_in_the_first_chunk_is_never_continued():
    backend, pushed = ScriptedLengths(), []
    partial = PartialRollouts(backend, 4, [1, 2], pushed.append, [EOS])
    job = GroupJob(index=0, prompt_ids=[(1, 4)], n=2, seed=0)
    (group,) = list(partial.generate([job], SamplingConfig(max_new_tokens=8), 1))
    assert group.token_versions == [[1], [1, 1, 1, 1]] and pushed == []
    assert len(backend.calls) == 1 and group.version_fingerprints == {1: "fp1"}


def test_the_chunk_versions_step_from_the_schedule_to_the_iterations_own():
    assert RolloutSchedule(1).chunk_versions(5, 3) == [4, 5, 5]
    assert RolloutSchedule(2).chunk_versions(5, 4) == [3, 4, 5, 5]
    assert RolloutSchedule(0).chunk_versions(5, 3) == [5, 5, 5]  # on-policy: never an update
    assert RolloutSchedule(2).chunk_versions(1, 3) == [0, 1, 1]
    switched = RolloutSchedule(0).switched(4, 1, version=4)
    assert switched.chunk_versions(4, 2) == [4, 4] and switched.chunk_versions(5, 2) == [4, 5]


def test_a_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="partial_rollout_tokens must be >= 1"):
        PartialRollouts(ScriptedLengths(), 0, [0, 1], lambda v: None, [EOS])
