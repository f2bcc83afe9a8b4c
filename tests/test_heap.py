"""keep_freed_memory: a large buffer freed and allocated again is reused, not page-faulted in
again; the environment's own allocator choice is left alone; a CPU trainer applies it."""

import subprocess
import sys

import pytest
from rl_helpers import train

from periodic_rl.cpu_tuning import heap

needs_glibc = pytest.mark.skipif(not heap.uses_glibc(), reason="mallopt is glibc's")

#: Allocates, fills and frees 256 MiB twice and prints the page faults of the second round.
SECOND_ROUND_FAULTS = """
import ctypes, resource, sys
from periodic_rl.cpu_tuning.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 256 << 20
def round_():
    buffer = libc.malloc(size)
    libc.memset(buffer, 1, size)
    libc.free(buffer)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_round_faults(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* or LD_PRELOAD from the caller
    out = subprocess.run(
        [sys.executable, "-c", SECOND_ROUND_FAULTS, mode],
        capture_output=True, text=True, check=True, env={**env, "PYTHONPATH": ":".join(sys.path)},
    )  # fmt: skip
    return int(out.stdout.strip())


@needs_glibc
def test_a_freed_buffer_is_reused_without_page_faults():
    pages = (256 << 20) // 4096
    assert second_round_faults("default") > pages // 2  # mmap, munmap, mmap: every page again
    assert second_round_faults("keep") < pages // 100  # the heap kept it


@needs_glibc
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MALLOC_MMAP_MAX_", "65536"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"),
    ],
)
def test_an_allocator_chosen_by_the_environment_is_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert heap.allocator_chosen()
    assert not heap.keep_freed_memory()


def test_a_cpu_trainer_keeps_freed_memory(tiny_llama_path, monkeypatch):
    calls = []
    monkeypatch.setattr("periodic_rl.cpu_tuning.plugin.keep_freed_memory", lambda: calls.append(1))
    train(tiny_llama_path, steps=1)
    assert calls == [1]
