"""``produce`` (rank 0's rollout thread) never lets an iteration train on a group set other than
the one planned: a backend that ends without some groups, returns one twice, or returns one not
asked for fails the iteration, on every rank, naming the jobs."""

from __future__ import annotations

import pytest
from test_dynamic_sampling import SAMPLING, RecordingLink, originals, scorer

from periodic_rl.rollout.producer import EndOfIteration, IterationPlan, produce
from periodic_rl.rollout.stream import GroupStream
from periodic_rl.rollout.types import GeneratedGroup


class ListBackend:
    """Returns the groups of the jobs whose index is in ``returned``, in that order."""

    def __init__(self, returned: list[int]) -> None:
        self.returned = returned
        self.groups_per_call: list[int | None] = []

    def generate(
        self,
        jobs,
        sampling,
        version,
        groups_per_call=None,
        ramp_groups=None,
        cancel=None,
        more_jobs=None,
    ):
        self.groups_per_call.append(groups_per_call)
        by_index = {job.index: job for job in jobs}
        for index in self.returned:
            job = by_index.get(index) or by_index[0]
            yield GeneratedGroup(index, [[job.seed]] * job.n, version, "fp", 0, job.seed)


def run(returned: list[int]):
    jobs = originals(4)
    plan = IterationPlan(jobs, [0, 0, 1, 1], SAMPLING, 0, None)
    stream = GroupStream()
    link = RecordingLink(2)
    produce(ListBackend(returned), plan, scorer(set()), stream, link)
    return stream, link


def test_every_planned_group_once_reaches_its_rank():
    stream, link = run([3, 0, 2, 1])
    assert sorted(g.index for g in stream.drain()) == [0, 1]
    assert sorted(g.index for g in link.sent[1][:-1]) == [2, 3]
    assert link.sent[1][-1] == EndOfIteration(None)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([0, 2, 3], r"1 of its 4 groups not generated \(jobs \[1\]\)"),
        ([0, 1, 1, 2, 3], "returned group 1 twice"),
        ([0, 1, 2, 3, 9], "returned group 9 not asked for"),
    ],
    ids=["missing", "twice", "not-asked-for"],
)
def test_a_group_missing_or_twice_fails_the_iteration_on_every_rank(returned, message):
    stream, link = run(returned)
    with pytest.raises(RuntimeError, match=message):
        stream.drain()
    end = link.sent[1][-1]
    assert isinstance(end, EndOfIteration) and end.error is not None


def test_the_plans_call_size_reaches_the_backend():
    backend = ListBackend([0, 1, 2, 3])
    plan = IterationPlan(originals(4), [0, 0, 0, 0], SAMPLING, 0, None, groups_per_call=4)
    produce(backend, plan, scorer(set()), GroupStream(), RecordingLink(1))
    assert backend.groups_per_call == [4]
