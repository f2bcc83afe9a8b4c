"""`RayRollouts`: rollout workers on Ray, fed prompt groups, streaming them back as they finish.

One iteration, from the strategy's side::

    rollouts.push_weights(state_dict, version)    # every worker verified to hold exactly these
    # (LoRA: push_weights(base, version, keep=adapted names) once, then push_adapter(...))
    for group in rollouts.generate(jobs, sampling, version):
        ...                                        # groups in completion order, each job once

Scheduling: jobs are cut into calls of ``groups_per_call`` groups; each worker's first call
and the iteration's last calls can be one micro-batch's worth (:func:`plan_calls`). A worker
holds at most ``max_calls_in_flight`` calls (2: it starts the next call while the result of the
previous one travels back), and a worker gets new work only when one of its calls completes, so
faster workers take more: load balanced by completion, not round robin.

Faults: a worker that dies (``RayActorError``) is replaced by a new actor on the same cores,
brought to the current weights (fingerprint checked), and its unfinished calls are dispatched
again with the same seeds (counted in ``RayRollouts.redispatched_calls``). A worker that
hangs (returns nothing within ``call_timeout_s``) is killed and handled the same way (counted
in ``RayRollouts.hung_restarts``). Calls the dead
worker had already finished are kept; nothing is lost or yielded twice, and the groups equal
those of a fault-free run (engines are seeded per group).

Ray and placement (:mod:`periodic_rl.rollout.workers.placement`): Ray is started by :meth:`start`,
locally on loopback unless ``ray_address`` is given; each worker runs in its own bundle of one
placement group, a restarted one in the same bundle.

Threads: ``generate`` may run in a producer thread, but one call at a time, and never together
with ``push_weights`` (the strategy joins its producer before it steps and pushes).
"""

from __future__ import annotations

import atexit
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from periodic_rl.compat.ray import actor_failed_in_init
from periodic_rl.rollout.processes import gather_within, reap, remove_unused_shm
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.timing import SpanRecorder, worker_lane
from periodic_rl.rollout.tuning import WorkerTuning
from periodic_rl.rollout.types import GeneratedGroup, GroupJob
from periodic_rl.rollout.workers.generation import StreamedGeneration
from periodic_rl.rollout.workers.placement import (
    WorkerPlacement,
    init_ray,
    node_label,
    ray_init_args,
    this_node,
    worker_bundle,
    worker_runtime_env,
)
from periodic_rl.rollout.workers.pushes import WeightPushes
from periodic_rl.rollout.workers.slots import (
    PushedWeights,
    Slot,
    WorkerHungError,
)
from periodic_rl.rollout.workers.worker import remote_worker

if TYPE_CHECKING:
    from periodic_rl.agents.config import AgentConfig

__all__ = ["GeneratedGroup", "GroupJob", "RayRollouts"]

log = logging.getLogger(__name__)


class RayRollouts(WeightPushes, StreamedGeneration):
    """A set of :class:`~periodic_rl.rollout.workers.worker.RolloutWorker` actors behind one API.

    Args:
        engine: what each worker builds.
        num_workers: number of workers (Ray actors).
        ray_address: an existing cluster to join; by default a new local one is started
            (only if Ray is not initialised in this process already).
        cpus_per_worker, gpus_per_worker: Ray resources reserved per worker.
        worker_cores: CPU cores to pin each worker to (one list per worker).
        worker_resources: further (custom) Ray resources each worker needs, e.g.
            ``{"rollout": 1}``: the workers then run only on nodes that offer them.
        placement_strategy: the Ray placement-group strategy of the workers' bundles (one per
            worker); ``start`` fails with the cluster's resources if they cannot be placed.
        push_transport: ``object_store`` (one ``ray.put``, read by every worker) or
            ``broadcast`` (a collective from this process into the workers).
        local_gpus: for a local Ray (no ``ray_address``), the CUDA devices of this machine it
            may give to workers (those no training rank uses); ``None``: all of them.
        groups_per_call: prompt groups per worker call (more: better batching; fewer: groups
            reach the trainer sooner).
        max_calls_in_flight: calls queued per worker at once.
        max_restarts: restarts in a row allowed per worker before a death (or hang) is fatal;
            a worker that returns a call starts counting again, so a long run survives
            any number of isolated deaths but not a worker that keeps failing.
        call_timeout_s: how long a worker may take per prompt group of a call (a call of ``g``
            groups gets ``g * call_timeout_s``, counted from when the worker finished its
            previous call) and for a weight load, before it counts as hung: it is killed
            (its processes too) and restarted like a dead worker, its calls sent again with
            the same seeds. The default, 600 s, is far above any healthy call (seconds); raise
            it for very long completions on slow hardware. ``None``: wait forever. Starting
            (and restarting) a worker is not timed: building an engine can take minutes.
        pythonpath: extra directories the workers must import from (a user's engine module).
        env_vars: extra environment variables for the workers.
        spans: where to record timing spans (a fresh :class:`SpanRecorder` by default).
        ray_init_kwargs: overrides for the local ``ray.init`` (e.g. ``num_cpus``,
            ``object_store_memory``).
        weight_load_cores: asked at each full weight push for the cores (the waiting
            trainer's) each worker may add to its own while it loads it, or None
            (:meth:`~periodic_rl.rollout.tuning.HardwareTuning.weight_load_cores`).
        worker_tuning: what each worker runs its weight loads in (the hardware tuner's part in
            the workers: :class:`~periodic_rl.rollout.tuning.WorkerTuning`).
        agent: multi-turn rollouts: each worker runs its jobs through an agent loop built from
            it (:mod:`periodic_rl.agents`); ``None``: one completion per sample.
    """

    def __init__(
        self,
        engine: EngineSpec,
        num_workers: int = 1,
        *,
        ray_address: str | None = None,
        cpus_per_worker: float = 1,
        gpus_per_worker: float = 0,
        worker_cores: list[list[int]] | None = None,
        worker_resources: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        push_transport: str = "object_store",
        local_gpus: list[int] | None = None,
        groups_per_call: int = 2,
        max_calls_in_flight: int = 2,
        max_restarts: int = 3,
        call_timeout_s: float | None = 600.0,
        pythonpath: list[str] | None = None,
        env_vars: dict[str, str] | None = None,
        spans: SpanRecorder | None = None,
        ray_init_kwargs: dict[str, Any] | None = None,
        weight_load_cores: Callable[[], list[int] | None] | None = None,
        worker_tuning: WorkerTuning | None = None,
        agent: AgentConfig | None = None,
    ) -> None:
        if not isinstance(engine, EngineSpec):
            raise TypeError(f"engine must be an EngineSpec, got {type(engine).__name__}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if worker_cores is not None and len(worker_cores) != num_workers:
            raise ValueError(f"worker_cores has {len(worker_cores)} entries for {num_workers}")
        if groups_per_call < 1 or max_calls_in_flight < 1:
            raise ValueError("groups_per_call and max_calls_in_flight must be >= 1")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0 or None, got {call_timeout_s}")
        self.spec, self.num_workers, self.ray_address = engine, num_workers, ray_address
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.worker_resources = dict(worker_resources or {})
        self.placement_strategy, self.push_transport = placement_strategy, push_transport
        self.local_gpus = list(local_gpus) if local_gpus is not None else None
        self.groups_per_call, self.max_calls_in_flight = groups_per_call, max_calls_in_flight
        self.max_restarts, self.call_timeout_s = max_restarts, call_timeout_s
        self.pythonpath = list(pythonpath or [])
        self.env_vars = dict(env_vars or {})
        self.spans = spans if spans is not None else SpanRecorder()
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.weight_load_cores = weight_load_cores
        self.worker_tuning = worker_tuning if worker_tuning is not None else WorkerTuning()
        self.agent = agent
        self._slots = [
            Slot(i, list(worker_cores[i]) if worker_cores else None) for i in range(num_workers)
        ]
        self.version: int | None = None  # None: the weights the engines were built from
        self.fingerprint: str | None = None
        self.restarts = 0
        self.redispatched_calls = 0  # calls lost with a dead worker and sent again
        self.hung_restarts = 0  # workers killed and restarted for exceeding call_timeout_s
        self.timings: dict[str, Any] = {}
        self._pushed: PushedWeights | None = None  # replayed to warm up restarted workers
        self._weights_ok = True
        self._actor_class: Any = None
        self._placement: WorkerPlacement | None = None
        self._owns_ray = False
        self._started = False
        self._closed = False
        self.poll_s = 1.0

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> RayRollouts:
        """Start Ray if needed, start every worker and wait until all hold the same weights."""
        if self._closed:
            raise RuntimeError("this RayRollouts was shut down; create a new one")
        if self._started:
            return self
        import ray

        began = time.time()
        if not ray.is_initialized():
            init_ray(self._ray_init_args(), self.local_gpus)
            self._owns_ray = True
        self.timings["ray_init_s"] = time.time() - began
        atexit.register(self.shutdown)
        self._started = True
        try:
            began = time.time()
            bundle = worker_bundle(
                self.cpus_per_worker, self.gpus_per_worker, self.worker_resources
            )
            if bundle:  # Ray refuses empty bundles; zero resources need no reservation
                bundles = [bundle] * self.num_workers
                self._placement = WorkerPlacement.reserve(bundles, self.placement_strategy)
            self.spans.label_lane("trainer", node_label("trainer", this_node()))
            self._actor_class = remote_worker(self.cpus_per_worker, self.gpus_per_worker)
            for slot in self._slots:
                self._launch(slot, None)
            fingerprints = [self._settle(slot, expected=None) for slot in self._slots]
        except BaseException:
            self.shutdown()
            raise
        self.timings["workers_start_s"] = time.time() - began
        self.timings["worker_startup_s"] = [slot.info.get("startup_s") for slot in self._slots]
        if len(set(fingerprints)) != 1:
            self.shutdown()
            raise RuntimeError(f"workers started with different weights: {fingerprints}")
        self.fingerprint = fingerprints[0]
        return self

    def _ray_init_args(self) -> dict[str, Any]:
        return ray_init_args(self.ray_address, self.ray_init_kwargs)

    def _launch(self, slot: Slot, weights: PushedWeights | None) -> None:
        """Start a new actor in ``slot``; its warm-up (weights load) runs asynchronously."""
        placed = self._placement.options(slot.index) if self._placement else {}  # its bundle
        slot.actor = self._actor_class.options(
            runtime_env=worker_runtime_env(self.pythonpath, self.env_vars), **placed
        ).remote(slot.index, self.spec, slot.cores, self.worker_tuning, self.agent)
        slot.incarnation += 1
        slot.in_flight = 0
        args = weights.warm_up_args() if weights is not None else (None, None)
        slot.ready = slot.actor.warm_up.remote(*args)

    def _settle(self, slot: Slot, expected: str | None) -> str:
        """Wait for a starting worker; check it holds ``expected`` weights; return its
        fingerprint. A worker that dies while starting is restarted (within the limit)."""
        import ray
        from ray.exceptions import RayActorError

        while slot.ready is not None:
            ref = slot.ready
            try:
                info = ray.get(ref)
            except RayActorError as error:
                if slot.ready is ref:
                    self._restart(slot, slot.incarnation, error)
                continue
            if slot.ready is not ref:
                continue
            if expected is not None and info["fingerprint"] != expected:
                raise RuntimeError(
                    f"rollout worker {slot.index} (pid {info['pid']}) restarted with weights "
                    f"{info['fingerprint']}, expected {expected} (version {self.version})"
                )
            slot.info, slot.ready = info, None
            self.spans.label_lane(
                worker_lane(slot.index), node_label(worker_lane(slot.index), info)
            )
        return slot.info["fingerprint"]

    def _restart(
        self,
        slot: Slot,
        incarnation: int,
        error: BaseException,
        weights: PushedWeights | None | Any = ...,
    ) -> None:
        """Replace the dead actor of ``slot`` (once per death) and bring it to ``weights``
        (default: the current ones); raises when the slot has used up its restarts."""
        if incarnation != slot.incarnation or self._closed:
            return  # this death was handled already (or we are shutting down)
        if actor_failed_in_init(error):  # the engine cannot be built: no retry
            raise RuntimeError(f"rollout worker {slot.index} failed to start: {error}") from error
        slot.restarts += 1
        slot.failures += 1
        self.restarts += 1
        hung = isinstance(error, WorkerHungError)
        if slot.failures > self.max_restarts:
            reason = (
                f"failed {slot.failures} times in a row (last: {error}); giving up (raise "
                "call_timeout_s if its calls are only slow)"
                if hung
                else f"died {slot.failures} times in a row; giving up"
            )
            raise RuntimeError(f"rollout worker {slot.index} {reason}") from error
        if not hung:  # a hang was logged where it was found
            log.warning("rollout worker %d died (%s); restarting it", slot.index, error)
        self._kill(slot)
        if weights is ...:
            self.weights_will_change()  # a restart loads the pushed weights' lasting copy
            weights = self._pushed
        self._launch(slot, weights)

    # ---- faults ---------------------------------------------------------------------------
    def _restart_hung(
        self, slot: Slot, waited: float, what: str, weights: PushedWeights | None | Any = ...
    ) -> None:
        """Kill the hung worker of ``slot`` (and its processes) and restart it like a dead one
        (onto ``weights``, default the current ones)."""
        pid = slot.info.get("pid")
        message = (
            f"rollout worker {slot.index} (pid {pid}) returned no {what} for {waited:.1f} s "
            f"(call_timeout_s={self.call_timeout_s:g})"
        )
        log.warning("%s: killing and restarting it", message)
        self.hung_restarts += 1
        self._restart(slot, slot.incarnation, WorkerHungError(message), weights)

    def repin(self, worker_cores: list[list[int]]) -> None:
        """Move the workers to ``worker_cores`` (one list per worker), between generations:
        each worker whose cores change moves its threads there in place
        (``RolloutWorker.move_to_cores``), keeping its engine and weights; a worker that dies
        meanwhile is restarted on its new cores, brought to the pushed weights (fingerprint
        checked). Returns once every worker runs on its cores. A move is not counted as a restart
        (a death during one is)."""
        import ray
        from ray.exceptions import RayActorError

        self._require_started()
        if len(worker_cores) != self.num_workers:
            raise ValueError(f"worker_cores has {len(worker_cores)} entries for {self.num_workers}")
        expected = self.fingerprint if self._weights_ok else None
        moved = [s for s in self._slots if s.cores != list(worker_cores[s.index])]
        calls = []
        for slot in moved:
            self._settle(slot, expected)  # a restarting worker holds its weights first
            slot.cores = list(worker_cores[slot.index])
            calls.append((slot, slot.incarnation, slot.actor.move_to_cores.remote(slot.cores)))
        for slot, incarnation, ref in calls:
            try:
                slot.info = ray.get(ref)
            except RayActorError as error:  # restarted on slot.cores
                self._restart(slot, incarnation, error)
                self._settle(slot, expected)

    # ---- introspection ----------------------------------------------------------------------
    def worker_pids(self) -> list[int]:
        """Process id of each worker (waits for restarting workers to be ready)."""
        return [info.get("pid", -1) for info in self.worker_info()]

    def worker_info(self) -> list[dict[str, Any]]:
        """What each worker reported at its last start or restart (waits for restarting
        workers to be ready)."""
        if self._started and not self._closed:
            self._settle_all()
        return [dict(slot.info) for slot in self._slots]

    def _require_started(self) -> None:
        if self._closed:
            raise RuntimeError("the Ray rollouts were shut down")
        if not self._started:
            raise RuntimeError("call RayRollouts.start() first")

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 20.0) -> None:
        """Stop every worker (gracefully, then by force), remove the ``/dev/shm`` files their
        processes used, and shut Ray down if this object started it. Idempotent; also runs at
        interpreter exit (``atexit``), so Ctrl-C leaves no worker processes behind."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            import ray

            self._close_copier()  # a copy for restarts still being put: finished first
            if not ray.is_initialized():
                return
            live = [s for s in self._slots if s.actor is not None]
            reports = gather_within([s.actor.shutdown.remote() for s in live], timeout_s / 2)
            for slot in live:
                self._kill(slot)
            leftovers = [p for r in reports for p in r.get("descendants", [])]
            reap(leftovers, timeout_s / 2)
            remove_unused_shm({f for r in reports for f in r.get("shm_files", [])})
            self._pushed = None
            if self._placement is not None:
                self._placement.remove()
        finally:
            self._close_broadcast()  # the trainer's weight group and its store, if any
            if self._owns_ray:
                import ray

                ray.shutdown()
                self._owns_ray = False

    def _kill(self, slot: Slot) -> None:
        """Kill the slot's actor and any child processes it had (vLLM's engine process)."""
        import ray

        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        slot.actor, slot.ready, slot.in_flight = None, None, 0
        if slot.info.get("host") in (None, socket.gethostname()):
            owned = [(slot.info.get("pid"), slot.info.get("pid_start"))]
            owned += [tuple(d) for d in slot.info.get("descendants", [])]
            reap([d for d in owned if d[0]], 5.0)

    def __enter__(self) -> RayRollouts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
