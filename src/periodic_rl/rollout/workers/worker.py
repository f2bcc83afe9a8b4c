"""`RolloutWorker`: one inference engine in its own process, driven as a Ray actor.

The class is plain Python; :func:`remote_worker` turns it into a Ray actor class with explicit
resources at the moment :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` starts (nothing
here touches Ray at import). The module imports neither torch nor vLLM at the top: a worker
must pin its CPU cores and set its thread and vLLM environment variables *before* those
libraries start their thread pools (an unpinned worker and trainer on the same cores slow each
other down; docs/troubleshooting.md, "Cores and memory").
The pinning, and the cleanup of what a worker's processes leave behind, are in
:mod:`periodic_rl.rollout.processes`.

Weights arrive as one Ray object holding a dict of numpy arrays, which every worker on a node
reads from the same shared-memory copy (:mod:`periodic_rl.weight_sync.transport`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from periodic_rl.rollout.processes import (
    LEFTOVER_SHM_PREFIXES,
    _start_time,
    descendants,
    pin_process,
    repin_threads,
    set_thread_env,
    shm_files,
)
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.tuning import WorkerTuning
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, SamplingConfig
from periodic_rl.weight_sync.shared_memory import SharedPush, SharedWeightsReader
from periodic_rl.weight_sync.transport import from_payload

if TYPE_CHECKING:
    from periodic_rl.agents.config import AgentConfig
    from periodic_rl.agents.loop import AgentLoop
    from periodic_rl.rollout.engine import InferenceEngine
    from periodic_rl.weight_sync.broadcast import BroadcastPlan, GroupAddress, WeightGroup

__all__ = [
    "GeneratedGroup",
    "GroupJob",
    "RolloutWorker",
    "StaleWeightsError",
    "remote_worker",
]

# Default vLLM CPU settings (docs/troubleshooting.md): don't keep a core idle. Set only when
# absent, so a user's own values win.
VLLM_ENV_DEFAULTS = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


class StaleWeightsError(RuntimeError):
    """A worker was asked to generate for a policy version other than the one it holds."""


# ---- the actor --------------------------------------------------------------------------------
class RolloutWorker:
    """Holds one engine; generates prompt groups and loads weights on request.

    Args:
        worker_id: the worker's number among its Ray rollouts (stamped on every group it generates).
        spec: the engine to build.
        cores: CPU cores to pin this process (and its engine's threads) to; ``None`` leaves
            placement to the OS and Ray (which sets ``OMP_NUM_THREADS`` from ``num_cpus``).
        agent: multi-turn rollouts: the worker runs its jobs through an agent loop
            (:mod:`periodic_rl.agents`); ``None``: one completion per sample.
    """

    def __init__(
        self,
        worker_id: int,
        spec: EngineSpec,
        cores: list[int] | None = None,
        tuning: WorkerTuning | None = None,
        agent: AgentConfig | None = None,
    ) -> None:
        started = time.time()
        self.worker_id = worker_id
        self.tuning = tuning if tuning is not None else WorkerTuning()
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
        from periodic_rl.agents.build import model_agent_loop  # imports torch: after pinning
        from periodic_rl.weight_sync.merge import AdapterLoader

        self.agent_loop: AgentLoop | None = (
            model_agent_loop(agent, spec.model) if agent is not None else None
        )
        self._adapter = AdapterLoader()
        self._shared_weights = SharedWeightsReader()  # the trainer's, mapped once
        self._weight_group: WeightGroup | None = None  # push_transport="broadcast"
        self.startup_s = time.time() - started
        self.last_load_s = 0.0
        self.last_load: dict[str, float] = {}  # phases of the last load_weights (load_timings)

    def info(self) -> dict[str, Any]:
        """Process id, child processes, cores, weights held, start-up time, and the Ray node
        it runs on (id and IP address: where the placement put it; ``None`` outside Ray)."""
        import ray

        in_ray = ray.is_initialized()
        return {
            "worker": self.worker_id,
            "pid": os.getpid(),
            "pid_start": _start_time(os.getpid()),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id() if in_ray else None,
            "node_ip": ray.util.get_node_ip_address() if in_ray else None,
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
        """Bring a (re)started worker to the other workers' current weights (the last full push,
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
        rollout can never silently come from other weights than its caller believes. Each
        group carries the engine's behaviour log-probs
        (:func:`~periodic_rl.rollout.engine.generate_groups`; ``[]`` from an engine that gives
        none) and, in multi-turn rollouts, its trajectories.
        """
        from periodic_rl.agents.build import run_jobs  # torch: loaded by the engine

        engine = self._engine()
        if self.version is not None and version != self.version:
            raise StaleWeightsError(
                f"worker {self.worker_id} holds weights version {self.version}, "
                f"asked to generate for version {version}"
            )
        started = time.time()
        outputs = run_jobs(engine, jobs, sampling, self.agent_loop)
        finished = time.time()
        return [
            GeneratedGroup(
                index=job.index,
                completion_ids=out.completions,
                version=version,
                fingerprint=self._fingerprint,
                worker=self.worker_id,
                seed=job.seed,
                started=started,
                finished=finished,
                logprobs=out.logprobs,
                trajectories=out.trajectories,
                agent_s=out.agent_s,
                engine_idle_s=out.engine_idle_s,
            )
            for job, out in zip(jobs, outputs, strict=True)
        ]

    def load_weights(
        self,
        weights: Any,
        version: int,
        keep: list[str] | None = None,
        borrow: list[int] | None = None,
    ) -> str:
        """Load new weights; returns the fingerprint the engine computed of what it received.

        ``weights`` is ``[ref]``, a one-element list holding the Ray object reference of a
        :func:`~periodic_rl.weight_sync.transport.to_payload` dict (wrapped so that Ray hands
        over the reference rather than the value; the worker fetches it from the shared object
        store itself), or the payload dict, or a
        :class:`~periodic_rl.weight_sync.shared_memory.SharedPush` (the trainer's tensors in
        shared memory, read in place: a trainer on this machine).
        ``keep``: the LoRA-adapted names, whose base weights this worker keeps for later
        :meth:`load_adapter` calls (:class:`~periodic_rl.weight_sync.merge.AdapterLoader`).
        ``borrow``: cores (the waiting trainer's) the hardware tuner may add to this worker's
        own for the load (:meth:`~periodic_rl.rollout.tuning.WorkerTuning.weight_load`).
        """
        engine = self._engine()
        with self.tuning.weight_load(borrow):
            started, faults = time.time(), _minor_faults()
            load_cores = len(os.sched_getaffinity(0))
            payload = _fetch(weights)
            if isinstance(payload, SharedPush):  # the trainer's memory, on this machine
                state_dict = self._shared_weights.read(payload)
            else:
                state_dict = from_payload(payload)
            del payload
            fetched = time.time()
            fingerprint = self._install(engine, state_dict, version, keep)
            del state_dict  # drop the shared-memory views: they pin the object
            ended = time.time()
        self.last_load_s = ended - started
        self.last_load = {
            "fetch_s": fetched - started,
            "install_s": ended - fetched,
            "minor_faults": _minor_faults() - faults,  # fresh pages touched: a cost of its own
            "load_cores": load_cores,  # its own, plus any borrowed for the load
            **getattr(engine, "last_load_timings", {}),
        }
        return fingerprint

    def _install(
        self,
        engine: InferenceEngine,
        state_dict: dict[str, Any],
        version: int,
        keep: list[str] | None,
    ) -> str:
        """Load a full state dict into ``engine`` (base kept for adapter pushes when ``keep``
        names the adapted weights); returns the engine's fingerprint of what landed."""
        fingerprint = engine.load_weights(state_dict)
        self._adapter.keep_base(engine, state_dict, keep, fingerprint)
        self._fingerprint = fingerprint
        self.version = version
        return fingerprint

    # ---- weights broadcast from the trainer (push_transport="broadcast") ---------------------
    def join_weight_group(self, address: GroupAddress, rank: int) -> str | None:
        """Join the trainer's weight group (:mod:`periodic_rl.weight_sync.broadcast`) as
        ``rank``, leaving any previous one; returns once every member has joined (raises after
        the group's timeout). Gloo connections bind to 127.0.0.1 for a local run, else to this
        node's address. Returns the UUID of this worker's GPU for NCCL (two ranks of one NCCL
        group cannot share a GPU), else ``None``."""
        from periodic_rl.weight_sync.broadcast import WeightGroup, local_bind_host

        self.leave_weight_group()
        host = local_bind_host(address.host)  # NCCL's interface: set by WeightGroup.join
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self._weight_group = WeightGroup.join(address, rank, host)
        return self._weight_group.device_uuid()

    def receive_weights(
        self, plan: BroadcastPlan, version: int, keep: list[str] | None = None
    ) -> str:
        """Receive a full push broadcast by the trainer (``plan``: the tensors, in order) into
        fresh tensors on this worker's device, then load it like :meth:`load_weights`; returns
        the engine's fingerprint. If the broadcast fails (a member died, the group timed out),
        this worker leaves the group and raises, its engine still holding its previous
        weights (nothing is loaded before every tensor arrived)."""
        engine = self._engine()
        group = self._weight_group
        if group is None or group.backend is None:
            raise RuntimeError(f"worker {self.worker_id} is in no weight group")
        started = time.time()
        try:
            state_dict = group.receive(plan)
        except BaseException:
            self.leave_weight_group()
            raise
        fingerprint = self._install(engine, state_dict, version, keep)
        del state_dict
        self.last_load_s = time.time() - started
        return fingerprint

    def leave_weight_group(self) -> None:
        """Leave the weight group, if in one (its connections close)."""
        group, self._weight_group = getattr(self, "_weight_group", None), None
        if group is not None:
            group.close()

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

    def move_to_cores(self, cores: list[int]) -> dict[str, Any]:
        """Move this worker, between generations, onto ``cores``: its threads on its cores
        until now move (:func:`~periodic_rl.rollout.processes.repin_threads`), the thread pools
        are sized to match, and the engine keeps its weights and caches (no restart). Returns
        :meth:`info`."""
        if not cores:
            raise ValueError("a worker needs at least one core")
        old = set(self.cores) if self.cores else os.sched_getaffinity(0)
        repin_threads(list(cores), old)
        set_thread_env(cores, self.spec.uses_vllm)
        self.cores = list(cores)
        return self.info()

    def load_timings(self) -> dict[str, float]:
        """Seconds of the last :meth:`load_weights`: ``fetch_s`` (the payload from the object
        store), ``install_s`` (the engine's load and fingerprint), and the engine's own
        breakdown where it keeps one (``last_load_timings``); ``minor_faults``: the page faults
        it took. Empty before the first load."""
        return {"load_s": self.last_load_s, **self.last_load} if self.last_load else {}

    def fingerprint(self) -> str:
        """Fingerprint of the weights the engine holds (the one stamped on generated groups)."""
        self._engine()
        return self._fingerprint

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> dict[str, Any]:
        """Shut the engine down; returns what the Ray rollouts must clean up if anything lingers:
        the ``descendants`` that were alive and the ``/dev/shm`` files they used."""
        me = os.getpid()
        family = descendants(me)
        files = shm_files([me, *(pid for pid, _ in family)], LEFTOVER_SHM_PREFIXES)
        self.leave_weight_group()
        if self.agent_loop is not None:
            self.agent_loop.close()
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
    """The payload of ``[ref]`` (from the object store), or the payload (or
    :class:`~periodic_rl.weight_sync.shared_memory.SharedPush`) itself, alone or in a list."""
    if isinstance(weights, list):
        (item,) = weights
        if isinstance(item, SharedPush):
            return item
        import ray

        return ray.get(item)
    return weights


def _minor_faults() -> int:
    """This process's minor page faults so far (first touches of memory it was given)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _torch_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def remote_worker(num_cpus: float, num_gpus: float) -> Any:
    """:class:`RolloutWorker` as a Ray actor class with explicit resources.

    Ray's own restarts are off (``max_restarts=0``):
    :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` restarts a dead worker itself,
    because a new actor must be given the current weights before it may generate again.
    """
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(
        RolloutWorker
    )
