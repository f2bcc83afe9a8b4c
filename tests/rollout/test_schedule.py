import pytest

from periodic_rl.rollout.calls import plan_calls
from periodic_rl.rollout.controller import RolloutController
from periodic_rl.rollout.options import RolloutOptions


def sizes(calls):
    return [len(c) for c in calls]


@pytest.mark.parametrize(
    ("n", "size", "workers", "ramp", "expected"),
    [
        (16, 2, 1, 1, [1, 2, 2, 2, 2, 2, 2, 2, 1]),
        (16, 4, 2, 1, [1, 1, 4, 4, 4, 1, 1]),
        (16, 4, 1, 2, [2, 4, 4, 4, 2]),
        (4, 2, 1, 1, [1, 2, 1]),
        (3, 2, 1, 1, [1, 1, 1]),
        (1, 2, 1, 1, [1]),
        (2, 2, 4, 1, [1, 1]),
        (0, 2, 1, 1, []),
        (7, 1, 2, 1, [1] * 7),
        (8, 2, 1, 2, [2, 2, 2, 2]),  # a micro-batch as large as a call: no ramp
        (7, 3, 2, None, [3, 3, 1]),  # no ramp asked: plain chunks
    ],
)
def test_calls_keep_order_and_every_job_once(n, size, workers, ramp, expected):
    jobs = list(range(n))
    calls = plan_calls(jobs, size, workers, ramp)
    assert sizes(calls) == expected
    assert [job for call in calls for job in call] == jobs


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="groups_per_call"):
        plan_calls([1], 0, 1)
    with pytest.raises(ValueError, match="ramp_groups"):
        plan_calls([1], 2, 1, 0)


@pytest.mark.parametrize(
    ("options", "groups", "expected"),
    [
        ({"overlap": False, "num_workers": 1}, 4, 4),  # the whole iteration in one call
        ({"overlap": False, "num_workers": 2}, 5, 3),  # each worker's share
        ({"overlap": False, "num_workers": 2, "groups_per_call": 1}, 5, 1),  # as asked
        ({"overlap": True, "num_workers": 1}, 4, None),  # the backend's streaming default
        ({"overlap": True, "num_workers": 1, "groups_per_call": 3}, 4, 3),
    ],
)
def test_without_overlap_a_worker_gets_its_share_in_one_call(options, groups, expected):
    controller = RolloutController(RolloutOptions(**options))
    assert controller.call_size(groups) == expected
