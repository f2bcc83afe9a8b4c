"""The benchmark harness's fairness between runs (``benchmarks/child_runs.py``,
``benchmarks/vs_trl.py``): every configuration runs in every place of the order, and a run's
leftover processes are gone before the next run starts. Real processes, no mocks."""

import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from child_runs import reap_session, settle  # noqa: E402
from vs_trl import run_order  # noqa: E402


def test_each_configuration_runs_in_every_place_of_the_order():
    configs = ["a", "c2", "e"]
    orders = [run_order(configs, repeat) for repeat in range(3)]
    assert orders == [["a", "c2", "e"], ["c2", "e", "a"], ["e", "a", "c2"]]
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(configs)
    assert run_order(configs, 3) == configs


def test_what_a_finished_run_left_in_its_session_is_reaped():
    """A run whose process exits while a helper it started keeps running (as vLLM's or Ray's
    can): the helper is killed after the wait, and counted."""
    script = "import subprocess as s; print(s.Popen(['sleep', '120'], stdout=s.DEVNULL).pid)"
    run = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    helper = int(run.communicate(timeout=60)[0])
    assert psutil.pid_exists(helper)
    left, waited = reap_session(run.pid, wait_s=1.0)
    assert left == 1
    assert waited >= 1.0
    deadline = time.monotonic() + 10
    while psutil.pid_exists(helper) and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the helper outlived the reaping"
        time.sleep(0.1)
    assert reap_session(run.pid, wait_s=1.0) == (0, 0.0)  # nothing left: no wait


def test_settling_gives_up_after_its_longest_wait():
    assert settle(max_busy_percent=100.0, quiet_s=1, max_wait_s=5.0) <= 5.0 + 1.5
    assert settle(max_busy_percent=-1.0, quiet_s=1, max_wait_s=1.0) >= 1.0  # never quiet
