import pytest

from periodic_rl.rollout.schedule import plan_calls


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
