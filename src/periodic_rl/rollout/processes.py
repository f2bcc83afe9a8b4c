"""Process and shared-memory housekeeping of the rollout workers: CPU pinning, the processes a
worker owns, and the cleanup of what they leave behind when they are killed.

Imports neither torch nor Ray at the top: the worker imports this module before it pins its
cores (see :mod:`periodic_rl.rollout.workers.worker`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LEFTOVER_SHM_PREFIXES",
    "alive",
    "all_cores",
    "cpu_list",
    "descendants",
    "gather_within",
    "pin_process",
    "reap",
    "remove_unused_shm",
    "repin_threads",
    "set_thread_env",
    "shm_files",
    "visible_gpus",
]


# ---- CPU placement ----------------------------------------------------------------------------
def cpu_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (the format of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    values = sorted(set(int(c) for c in cores))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def pin_process(cores: list[int], uses_vllm: bool) -> None:
    """Pin this process to ``cores`` and size every thread pool to match.

    Must run before torch (or vLLM) creates its threads: OpenMP sizes its pool at first use.
    """
    if not cores:
        raise ValueError("worker_cores entries must not be empty")
    available = os.cpu_count() or 1
    bad = [c for c in cores if not 0 <= c < available]
    if bad:
        raise ValueError(f"cores {bad} do not exist on this machine ({available} CPUs)")
    os.sched_setaffinity(0, set(cores))
    set_thread_env(cores, uses_vllm)
    import torch

    torch.set_num_threads(len(cores))


def set_thread_env(cores: list[int], uses_vllm: bool) -> None:
    """The thread-pool variables for ``cores`` (OpenMP, MKL and, for vLLM, its OpenMP binding),
    read by libraries that start their pools from now on."""
    threads = str(len(cores))
    os.environ["OMP_NUM_THREADS"] = threads
    os.environ["MKL_NUM_THREADS"] = threads
    if uses_vllm:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)


def repin_threads(cores: list[int], moved_from: set[int]) -> int:
    """Move this running process onto ``cores``: every thread pinned within ``moved_from`` (the
    process's cores until now, or some of them, as vLLM pins each OpenMP thread to one core;
    threads that chose other cores, such as a background writer allowed on every core, keep
    them), and torch's thread pool sized to match (its threads started from now on inherit the
    caller's cores). Returns how many threads moved.

    ``os.sched_setaffinity(0, ...)`` alone would move the calling thread only.
    """
    if not cores:
        raise ValueError("cannot pin to no cores")
    moved = 0
    for entry in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(entry)) <= moved_from:
                os.sched_setaffinity(int(entry), set(cores))
                moved += 1
        except OSError:  # the thread ended meanwhile
            continue
    os.sched_setaffinity(0, set(cores))
    import torch

    torch.set_num_threads(len(cores))
    return moved


# ---- the processes a worker owns (for cleanup after it is killed) --------------------------
def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks (tells a pid from a later reuse of it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start_time)`` of every live descendant of ``pid`` (e.g. vLLM's engine process)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[tuple[int, int]] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        started = _start_time(child)
        if started is not None:
            found.append((child, started))
        stack.extend(children.get(child, []))
    return found


# What vLLM (torch's shared-memory manager, multiprocessing semaphores) leaves behind. Ray's own
# /dev/shm files (the plasma store, its semaphores) are never touched.
LEFTOVER_SHM_PREFIXES = ("psm_", "sem.mp-")


def shm_files(pids: Iterable[int], prefixes: tuple[str, ...] | None = None) -> list[str]:
    """Existing ``/dev/shm`` files that the processes ``pids`` hold open or mapped (files
    already unlinked are skipped), optionally only those whose name starts with ``prefixes``.

    vLLM leaves ``psm_*`` and ``sem.mp-*`` files behind when its processes are killed: the
    Ray rollouts remove those their own workers used, never another program's.
    """
    found: set[str] = set()
    for pid in pids:
        try:
            targets: list[str] = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                targets += [
                    line.split(maxsplit=5)[5].strip()
                    for line in maps
                    if line.count(" ") >= 5 and "/dev/shm/" in line
                ]
        except (OSError, IndexError):
            continue
        found.update(
            t for t in targets if t.startswith("/dev/shm/") and not t.endswith(" (deleted)")
        )
    if prefixes is not None:
        found = {f for f in found if os.path.basename(f).startswith(prefixes)}
    return sorted(found)


def gather_within(refs: list[Any], timeout_s: float) -> list[dict[str, Any]]:
    """Results of the workers' ``shutdown`` calls that finish within ``timeout_s``."""
    import ray

    if not refs:
        return []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    reports = []
    for ref in done:
        try:
            reports.append(ray.get(ref))
        except Exception:  # noqa: BLE001 - a dead worker has nothing to report
            pass
    return reports


def alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` still runs and is the same process (not a reuse, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and (start is None or _start_time(pid) == start)


def reap(processes: list[tuple[int, int | None]], timeout_s: float) -> None:
    """Wait for ``processes`` to exit; SIGKILL those still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p, s) for p, s in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, start in processes:
        if alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def remove_unused_shm(paths: set[str]) -> None:
    """Unlink the ``/dev/shm`` files our workers left, unless a live process still uses one."""
    if not paths:
        return
    others = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for path in paths - set(shm_files(others)):
        try:
            os.unlink(path)
        except OSError:
            pass


@contextmanager
def all_cores() -> Iterator[None]:
    """Let the processes started inside (Ray's raylet, hence every worker) use every core.

    Affinity is inherited: if the trainer pinned itself before starting Ray, unpinned workers
    would otherwise all be squeezed onto the trainer's cores.
    """
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def visible_gpus(gpus: list[int] | None) -> Iterator[None]:
    """Let the processes started inside (a local Ray's raylet, which hands GPUs to workers)
    see only the CUDA devices ``gpus`` (``None``: leave ``CUDA_VISIBLE_DEVICES`` as it is).

    Ray numbers the GPUs of a node from ``CUDA_VISIBLE_DEVICES`` when it starts; the training
    ranks' own devices, already in use by this process, are unaffected by the change.
    """
    if gpus is None:
        yield
        return
    name = "CUDA_VISIBLE_DEVICES"
    before = os.environ.get(name)
    shown = before.split(",") if before else [str(i) for i in range(max(gpus, default=-1) + 1)]
    os.environ[name] = ",".join(shown[i] for i in gpus if i < len(shown))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# ---- core loans: widening a process onto another's idle cores -------------------------------
def _thread_ids() -> set[int]:
    return {int(entry) for entry in os.listdir("/proc/self/task")}


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # the thread ended meanwhile
        return None


def _move(tids: Iterable[int], cores: set[int]) -> None:
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            continue


@dataclass
class CoreLoan:
    """Lends another process's idle cores to this one: the workers' to the trainer between
    generation and the push, the trainer's to a worker while it loads a push.

    ``lent_s``: seconds the cores were lent in all, ``loans``: loans made (for metrics and
    tests); ``own``: this process's cores while a loan is out (``None`` otherwise).
    Times are ``time.time()`` seconds, like the spans of :mod:`periodic_rl.rollout.timing`.
    When to lend is the CPU tuner's (:mod:`periodic_rl.cpu_tuning.core_loan`).
    """

    lent_s: float = 0.0
    loans: int = 0
    own: set[int] | None = None
    _moved: set[int] = field(default_factory=set)
    _before: set[int] = field(default_factory=set)
    _since: float = 0.0

    @property
    def lent(self) -> bool:
        return self.own is not None

    def lend(self, cores: Iterable[int]) -> bool:
        """Widen this process to its own cores plus ``cores`` (their owner must leave them idle
        until :meth:`give_back`). Returns whether a loan began: not when one is out already,
        nor when this process already runs on every one of those cores."""
        if self.lent:
            return False
        own = os.sched_getaffinity(0)
        wide = own | {int(c) for c in cores}
        if wide == own:
            return False
        import torch

        self._before = _thread_ids()
        self._moved = {t for t in self._before if _affinity(t) == own}
        _move(self._moved, wide)
        os.sched_setaffinity(0, wide)
        torch.set_num_threads(len(wide))
        self.own, self._since = own, time.time()
        self.loans += 1
        return True

    def give_back(self) -> tuple[float, float] | None:
        """Back onto this process's own cores; the loan's ``(start, end)``, or ``None`` (and
        nothing done) without a loan out."""
        if self.own is None:
            return None
        import torch

        own, wide = self.own, os.sched_getaffinity(0)
        started = {t for t in _thread_ids() - self._before if _affinity(t) == wide}
        _move(self._moved | started, own)
        os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own))
        end = time.time()
        self.lent_s += end - self._since
        self.own, self._moved, self._before = None, set(), set()
        return self._since, end
