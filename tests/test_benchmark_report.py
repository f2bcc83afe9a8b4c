"""The benchmark's overlapped-vs-synchronous verdict (``benchmarks/vs_trl_report.versus_sync``)
on step times written by hand: SLOWER only when the paired steps say so beyond their noise."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vs_trl_report import paired_ratios, versus_sync  # noqa: E402


def row(*repeats: list[float]) -> dict:
    """A summary row: per-repeat step times, and the median of all of them pooled."""
    steps = sorted(x for r in repeats for x in r)
    middle = len(steps) // 2
    median = steps[middle] if len(steps) % 2 else (steps[middle - 1] + steps[middle]) / 2
    return {
        "s_per_step": median,
        "per_repeat": [{"repeat": i, "step_s": list(r)} for i, r in enumerate(repeats)],
    }


SYNC = row([10.0, 10.4, 9.8], [10.2, 9.9, 10.1], [10.0, 10.3, 9.7])


@pytest.mark.parametrize(
    ("other", "verdict"),
    [
        (row([11.0, 11.5, 10.9], [11.2, 11.0, 11.1], [11.3, 11.4, 10.8]), "SLOWER"),
        (row([10.1, 10.3, 9.9], [10.3, 9.8, 10.2], [10.1, 10.2, 9.8]), "within noise"),
        (row([9.0, 9.5, 9.1], [9.2, 9.0, 9.1], [9.3, 9.4, 9.0]), "not slower"),
    ],
)
def test_the_verdict_follows_the_paired_steps(other, verdict):
    ratio, said, evidence = versus_sync(SYNC, other)
    assert said == verdict
    assert ratio == pytest.approx(SYNC["s_per_step"] / other["s_per_step"])
    assert evidence.startswith("9 paired steps")
    assert versus_sync(SYNC, other) == (ratio, said, evidence)  # a fixed seed: reproducible


def test_steps_pair_by_repeat_and_index_only():
    other = row([5.0, 20.0], [10.0])  # repeat 1 has one step; repeat 2 none
    assert paired_ratios(SYNC, other) == [2.0, 10.4 / 20.0, 10.2 / 10.0]


def test_where_auto_ended_reads_the_split_that_ran():
    """A deferred plan was advice only: the run is reported taking turns, as it started."""
    from benchmarks_doc import split_choice

    moved = {"split/overlap": 1.0, "split/trainer_cores": 1.0, "split/worker_cores": 1.0}
    assert split_choice({"seed": 0, "split": moved}).startswith("seed 0: overlapped (trainer 1")
    deferred = moved | {"split/deferred": 1.0}
    text = split_choice({"seed": 1, "split": deferred})
    assert text.startswith("seed 1: taking turns, as it started (advised: overlapped")
    assert split_choice({"seed": 2}) == "seed 2: no split recorded"
