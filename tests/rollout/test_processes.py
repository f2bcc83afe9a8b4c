"""Process and shared-memory housekeeping of the rollout workers: core lists, descendants,
the /dev/shm files they hold."""

from __future__ import annotations

import subprocess
import sys

from periodic_rl.rollout.processes import cpu_list, descendants, shm_files


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
