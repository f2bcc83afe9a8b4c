"""`RolloutWorker`: one inference engine in its own process, driven as a Ray actor.

The class is plain Python; :func:`remote_worker` turns it into a Ray actor class with explicit
resources at the moment a fabric starts (nothing here touches Ray at import). The module imports
neither torch nor vLLM at the top: a worker must pin its CPU cores and set its thread and vLLM
environment variables *before* those libraries start their thread pools (an unpinned worker and
trainer on the same cores both ran 2-3x slower; docs/troubleshooting.md, "Cores and memory").

Weights arrive as one Ray object holding a dict of numpy arrays, which every worker on a node
reads from the same shared-memory copy (:mod:`periodic_rl.weight_sync.transport`).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig
from periodic_rl.weight_sync.transport import from_payload

if TYPE_CHECKING:
    from periodic_rl.rollout.engine import InferenceEngine

__all__ = [
    "GeneratedGroup",
    "GroupJob",
    "RolloutWorker",
    "StaleWeightsError",
    "cpu_list",
    "remote_worker",
]

# Default vLLM CPU settings (docs/troubleshooting.md): don't keep a core idle, let collective_rpc
# carry importable functions. Set only when absent, so a user's own values win.
VLLM_ENV_DEFAULTS = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


class StaleWeightsError(RuntimeError):
    """A worker was asked to generate for a policy version other than the one it holds."""


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
    threads = str(len(cores))
    os.environ["OMP_NUM_THREADS"] = threads
    os.environ["MKL_NUM_THREADS"] = threads
    if uses_vllm:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)
    import torch

    torch.set_num_threads(len(cores))


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
    fabric removes those its own workers used, never another program's.
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


# ---- the actor --------------------------------------------------------------------------------
class RolloutWorker:
    """Holds one engine; generates prompt groups and loads weights on request.

    Args:
        worker_id: the worker's number in its fabric (stamped on every group it generates).
        spec: the engine to build.
        cores: CPU cores to pin this process (and its engine's threads) to; ``None`` leaves
            placement to the OS and Ray (which sets ``OMP_NUM_THREADS`` from ``num_cpus``).
    """

    def __init__(self, worker_id: int, spec: EngineSpec, cores: list[int] | None = None) -> None:
        started = time.time()
        self.worker_id = worker_id
        self.spec = spec
        self.cores = list(cores) if cores else None
        if spec.uses_vllm:
            for key, value in VLLM_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        if self.cores:
            pin_process(self.cores, spec.uses_vllm)
        self.engine: InferenceEngine | None = spec.build()
        self.version: int | None = None  # None: the weights the engine was built from
        self._fingerprint = self.engine.fingerprint()
        from periodic_rl.weight_sync.merge import AdapterLoader  # imports torch: after pinning

        self._adapter = AdapterLoader()
        self.startup_s = time.time() - started
        self.last_load_s = 0.0

    def info(self) -> dict[str, Any]:
        """Process id, child processes, cores, weights held and start-up time."""
        return {
            "worker": self.worker_id,
            "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()),
            "host": socket.gethostname(),
            "descendants": descendants(os.getpid()),
            "cores": self.cores,
            "affinity": sorted(os.sched_getaffinity(0)),
            "threads": _torch_threads(),
            "version": self.version,
            "fingerprint": self._fingerprint,
            "startup_s": self.startup_s,
            "last_load_s": self.last_load_s,
        }

    def warm_up(
        self,
        weights: list[Any] | None,
        version: int | None,
        keep: list[str] | None = None,
        adapter: list[Any] | None = None,
    ) -> dict[str, Any]:
        """Bring a (re)started worker to the fabric's current weights (the last full push,
        then the last adapter push on it, if any), then report :meth:`info`."""
        if weights is not None and version is not None:
            self.load_weights(weights, version, keep)
            if adapter is not None:
                self.load_adapter(adapter, version)
        return self.info()

    def generate(
        self, jobs: list[GroupJob], sampling: SamplingConfig, version: int
    ) -> list[GeneratedGroup]:
        """Generate ``jobs`` and stamp each group with the weights and the call's time span.

        Refuses (:class:`StaleWeightsError`) a ``version`` other than the loaded one, so a
        rollout can never silently come from other weights than its caller believes.
        """
        engine = self._engine()
        if self.version is not None and version != self.version:
            raise StaleWeightsError(
                f"worker {self.worker_id} holds weights version {self.version}, "
                f"asked to generate for version {version}"
            )
        started = time.time()
        outputs = engine.generate([job.request() for job in jobs], sampling)
        finished = time.time()
        if len(outputs) != len(jobs):
            raise RuntimeError(f"engine returned {len(outputs)} groups for {len(jobs)} jobs")
        return [
            GeneratedGroup(
                index=job.index,
                completion_ids=[list(map(int, c)) for c in completions],
                version=version,
                fingerprint=self._fingerprint,
                worker=self.worker_id,
                seed=job.seed,
                started=started,
                finished=finished,
            )
            for job, completions in zip(jobs, outputs, strict=True)
        ]

    def load_weights(self, weights: Any, version: int, keep: list[str] | None = None) -> str:
        """Load new weights; returns the fingerprint the engine computed of what it received.

        ``weights`` is ``[ref]``, a one-element list holding the Ray object reference of a
        :func:`~periodic_rl.weight_sync.transport.to_payload` dict (wrapped so that Ray hands
        over the reference rather than the value; the worker fetches it from the shared object
        store itself), or the payload dict.
        ``keep``: the LoRA-adapted names, whose base weights this worker keeps for later
        :meth:`load_adapter` calls (:class:`~periodic_rl.weight_sync.merge.AdapterLoader`).
        """
        engine = self._engine()
        started = time.time()
        state_dict = from_payload(_fetch(weights))
        fingerprint = engine.load_weights(state_dict)
        self._adapter.keep_base(engine, state_dict, keep, fingerprint)
        del state_dict  # drop the shared-memory views: they pin the object
        self._fingerprint = fingerprint
        self.version = version
        self.last_load_s = time.time() - started
        return fingerprint

    def load_adapter(self, adapter: Any, version: int) -> str:
        """Merge a LoRA adapter payload (:mod:`periodic_rl.weight_sync.merge`; passed like
        ``weights`` of :meth:`load_weights`) into the kept base weights and load the merged
        ones; returns the :func:`~periodic_rl.weight_sync.fingerprint.adapter_fingerprint` it
        computed."""
        engine = self._engine()
        started = time.time()
        payload = from_payload(_fetch(adapter))
        fingerprint = self._adapter.load(engine, payload)
        del payload
        self._fingerprint = fingerprint
        self.version = version
        self.last_load_s = time.time() - started
        return fingerprint

    def fingerprint(self) -> str:
        """Fingerprint of the weights the engine holds (the one stamped on generated groups)."""
        self._engine()
        return self._fingerprint

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> dict[str, Any]:
        """Shut the engine down; returns what the fabric must clean up if anything lingers:
        the ``descendants`` that were alive and the ``/dev/shm`` files they used."""
        me = os.getpid()
        family = descendants(me)
        files = shm_files([me, *(pid for pid, _ in family)], LEFTOVER_SHM_PREFIXES)
        if self.engine is not None:
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
        return {"pid": me, "descendants": family, "shm_files": files}

    def _engine(self) -> InferenceEngine:
        if self.engine is None:
            raise RuntimeError(f"worker {self.worker_id} has been shut down")
        return self.engine


def _fetch(weights: Any) -> Any:
    """The payload of ``[ref]`` (from the object store) or the payload itself."""
    if isinstance(weights, list):
        import ray

        (payload,) = ray.get(weights)
        return payload
    return weights


def _torch_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def remote_worker(num_cpus: float, num_gpus: float) -> Any:
    """:class:`RolloutWorker` as a Ray actor class with explicit resources.

    Ray's own restarts are off (``max_restarts=0``): the fabric restarts a dead worker itself,
    because a new actor must be given the current weights before it may generate again.
    """
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(
        RolloutWorker
    )
