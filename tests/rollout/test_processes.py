"""Process and shared-memory housekeeping of the rollout workers: core lists, descendants,
the /dev/shm files they hold."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from periodic_rl.rollout.processes import cpu_list, descendants, repin_threads, shm_files


def test_cpu_list():
    assert cpu_list([3, 0, 1, 2, 7, 9, 8]) == "0-3,7-9"
    assert cpu_list([1]) == "1"


def test_descendants_and_shm_files(tmp_path):
    script = (
        "import mmap, os, time\n"
        "fd = os.open('/dev/shm/periodic_rl_test_shm', os.O_CREAT | os.O_RDWR)\n"
        "os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        import os

        family = descendants(os.getpid())
        assert child.pid in [pid for pid, _ in family]
        assert "/dev/shm/periodic_rl_test_shm" in shm_files([child.pid])
        assert shm_files([child.pid], ("psm_",)) == []
    finally:
        child.kill()
        child.wait()
        import os

        os.unlink("/dev/shm/periodic_rl_test_shm")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moves threads between two cores")
def test_repin_threads_moves_the_threads_within_the_old_cores_only():
    """From two cores to one: threads pinned to both, or to one of them (as vLLM pins its
    OpenMP threads), move; a thread allowed on more cores than the old ones (a background
    writer; with a third core) keeps them."""
    import torch

    every = os.sched_getaffinity(0)
    first, second = sorted(every)[:2]
    old = {first, second}
    threads, tids, ready, done = (
        torch.get_num_threads(),
        {},
        threading.Barrier(3),
        threading.Event(),
    )

    def park(name: str, cores: set[int]) -> None:
        os.sched_setaffinity(0, cores)
        tids[name] = threading.get_native_id()
        ready.wait()
        done.wait()

    workers = [
        threading.Thread(target=park, args=("one core", {first})),
        threading.Thread(target=park, args=("every core", every)),
    ]
    try:
        os.sched_setaffinity(0, old)
        for t in workers:
            t.start()
        ready.wait()
        assert repin_threads([second], old) >= 2  # this thread and the one-core one
        assert os.sched_getaffinity(0) == {second} == os.sched_getaffinity(tids["one core"])
        kept = every if every != old else {second}  # on two cores "every" is the old cores
        assert os.sched_getaffinity(tids["every core"]) == kept
        assert torch.get_num_threads() == 1
    finally:
        done.set()
        for t in workers:
            t.join()
        os.sched_setaffinity(0, every)
        torch.set_num_threads(threads)
