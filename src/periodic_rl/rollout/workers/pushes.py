"""Weight pushes of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts`: full and LoRA
adapter.

A full push sends a state dict (one ``ray.put``) that every worker loads and fingerprints; with
``keep`` (the LoRA-adapted names) the workers also keep their base weights, and from then on
:meth:`WeightPushes.push_adapter` sends only the adapter factors
(:func:`~periodic_rl.weight_sync.export.lora_adapter_payload`), which every worker merges into
its kept base (:mod:`periodic_rl.weight_sync.merge`). Either way every worker's reported
fingerprint is checked against the one computed here, and a worker that dies during a push, or
whose load does not return within ``call_timeout_s`` (it is killed), is restarted straight onto
the pushed weights (base and adapter replayed).

Transports (``push_transport``): ``object_store`` as above, except that a full push to workers
of a Ray started on this machine goes through shared memory (the workers read the trainer's
tensors in place, :mod:`periodic_rl.weight_sync.shared_memory`; the object-store copy that
restarted workers load is put in the background afterwards,
:meth:`WeightPushes.weights_will_change`); ``broadcast`` sends a full push as collectives from
this process straight into the workers (NCCL from CUDA tensors into workers with GPUs, else
gloo; :mod:`periodic_rl.weight_sync.broadcast`), with no host round trip on GPUs. The
fingerprint is still computed from a host copy (made and hashed in a thread while the broadcast
runs), and that copy is still put in the object store after the broadcast: restarted workers
warm up from it. A broadcast that fails (a worker died, the group timed out)
tears the group down and the push is completed through the object store; the next push forms a
new group. Adapter pushes are small and always go through the object store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from periodic_rl.rollout.workers.broadcast import BroadcastChannel
from periodic_rl.rollout.workers.slots import PushedWeights, Slot, SlotOwner
from periodic_rl.weight_sync.broadcast import Backend, BroadcastPlan
from periodic_rl.weight_sync.fingerprint import adapter_fingerprint, weights_fingerprint
from periodic_rl.weight_sync.shared_memory import SharedPush, share
from periodic_rl.weight_sync.shared_memory import enabled as shared_memory_enabled
from periodic_rl.weight_sync.transport import to_payload

if TYPE_CHECKING:
    from periodic_rl.rollout.timing import SpanRecorder

log = logging.getLogger(__name__)

#: Timings only a broadcast push records.
_BROADCAST_TIMINGS = (
    "last_push_group_s",
    "last_push_broadcast_s",
    "last_push_group_generation",
    "last_push_group_formed",
)


@dataclass
class _RestartCopy:
    """A shared-memory push's copy for restarted workers: its tensors, the push it copies, and
    the background put once started."""

    state_dict: dict[str, torch.Tensor]
    pushed: PushedWeights
    put: Future | None = None


class WeightPushes(SlotOwner):
    """The weight-push half of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` (a mixin:
    the class it is mixed into owns the state it uses)."""

    _pushed: PushedWeights | None
    weight_load_cores: Callable[[], list[int] | None] | None
    timings: dict[str, Any]
    spans: SpanRecorder
    push_transport: str
    ray_address: str | None
    gpus_per_worker: float
    #: The broadcast group's timeout (forming it, and each collective): a member that died or
    #: hangs fails the broadcast after at most this long (a death usually at once).
    broadcast_timeout_s: float = 120.0
    _channel: BroadcastChannel | None = None
    _copier: ThreadPoolExecutor | None = None  # puts shared-memory pushes' restart copies
    _restart_copy: _RestartCopy | None = None

    def push_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, keep: list[str] | None = None
    ) -> str:
        """Load ``state_dict`` on every worker (one ``ray.put``) and check every worker's
        fingerprint against :func:`weights_fingerprint`; returns it. Raises ``RuntimeError``
        naming the worker(s) on a mismatch (generation is refused until a push succeeds).

        ``keep``: LoRA-adapted weight names; the workers keep their base weights so that
        :meth:`push_adapter` can send only the adapter from then on.
        """
        import ray

        if self.push_transport == "broadcast":
            if self._channel is None or self._channel.unusable is None:
                return self._broadcast_weights(state_dict, version, keep)
            # else through the object store (the reason was logged when it was found)
        if self.push_transport != "object_store":
            raise ValueError(
                f"push_transport must be 'object_store' or 'broadcast', got {self.push_transport!r}"
            )
        self._require_started()
        self.weights_will_change()  # the last push's copy for restarts is complete
        self._settle_all()
        began = time.time()
        state_dict = {name: t.detach().cpu() for name, t in state_dict.items()}  # once, if on GPU
        keep = sorted(keep) if keep is not None else None
        if keep is not None and not set(keep) <= state_dict.keys():
            raise KeyError(
                f"keep names weights not pushed: {sorted(set(keep) - state_dict.keys())}"
            )
        shared = self._shared_push(state_dict, keep)
        base: Any = shared if shared is not None else ray.put(to_payload(state_dict))
        put = time.time()
        # the workers may load on this process's cores too: it only waits for them now
        borrow = self.weight_load_cores() if self.weight_load_cores is not None else None
        calls = [
            (s, s.incarnation, s.actor.load_weights.remote([base], version, keep, borrow))
            for s in self._slots
        ]
        # Hashed after the put, while the workers load: the put has this process's cores to
        # itself (a hash thread during the put would take its share of them), and the workers' loads
        # take far longer than the hash, which is done before the first of them reports.
        try:
            expected = weights_fingerprint(state_dict)
        except BaseException:  # the workers are loading: what they hold is unknown now
            self._weights_ok, self._pushed = False, None
            raise
        hashed = time.time()
        target = PushedWeights(base, version, expected, keep)
        kind = "full" if keep is None else "base"
        self._collect(calls, target, expected, f"weight push of version {version}")
        end = time.time()
        if shared is not None:
            self._copy_for_restarts(state_dict, target)
        for key in _BROADCAST_TIMINGS:  # of an earlier broadcast push
            self.timings.pop(key, None)
        self.timings.update(
            last_push_s=end - began,
            last_push_put_s=put - began,
            last_push_hash_done_s=hashed - began,  # the hash overlaps the loads
            last_push_load_s=end - put,
            last_push_kind=kind,
            last_push_transport="shared_memory" if shared is not None else "object_store",
        )
        self.spans.add("weight push", "weights", began, end, version=version, kind=kind)
        return expected

    def _broadcast_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, keep: list[str] | None
    ) -> str:
        """:meth:`push_weights` by broadcast (module docstring): form the group if needed, ask
        every worker to receive, broadcast, then put the host copy for restarts and collect the
        workers' fingerprints. A failed broadcast falls back to the object store."""
        import ray

        self._require_started()
        self._settle_all()
        began = time.time()
        keep = sorted(keep) if keep is not None else None
        if keep is not None and not set(keep) <= state_dict.keys():
            raise KeyError(
                f"keep names weights not pushed: {sorted(set(keep) - state_dict.keys())}"
            )
        tensors = {name: t.detach() for name, t in state_dict.items()}
        backend = self._broadcast_backend(tensors)
        if backend == "gloo":  # gloo sends from host memory: the one host copy serves all
            tensors = {name: t.cpu() for name, t in tensors.items()}
        plan = BroadcastPlan.of(tensors)
        channel = self._broadcast_channel()
        generation = channel.generation
        calls: list[tuple[Slot, int, Any]] = []
        failure: BaseException | None = None
        formed = began
        with ThreadPoolExecutor(1, thread_name_prefix="weights-fingerprint") as pool:
            hashing = pool.submit(_host_copy_and_fingerprint, tensors, plan)
            try:
                group = channel.group_for(self._slots, backend)
                formed = time.time()
                calls = [
                    (s, s.incarnation, s.actor.receive_weights.remote(plan, version, keep))
                    for s in self._slots
                ]
                group.send(plan, tensors)
            except Exception as error:  # noqa: BLE001 - completed through the object store
                failure = error
                channel.close_group()
            sent = time.time()
            host, expected = hashing.result()
            hashed = time.time()
        del tensors
        ref = ray.put(to_payload(host))  # what restarted workers warm up from
        del host
        put = time.time()
        target = PushedWeights(ref, version, expected, keep)
        kind = "full" if keep is None else "base"
        transport = "broadcast"
        if failure is not None:
            log.warning(
                "weight broadcast of version %s failed (%s); completing the push through the "
                "object store%s",
                version,
                failure,
                ", as every later push" if channel.unusable else "",
            )
            transport = f"object_store (broadcast failed: {type(failure).__name__})"
            calls = self._after_failed_broadcast(calls, [ref], version, keep)
        self._collect(calls, target, expected, f"weight push of version {version}")
        end = time.time()
        self.timings.update(
            last_push_s=end - began,
            last_push_group_s=formed - began,  # forming the group (0 when it was kept)
            last_push_broadcast_s=sent - formed,
            last_push_hash_done_s=hashed - began,  # the copy and hash overlap the broadcast
            last_push_put_s=put - hashed,  # after the broadcast, for restart warm-ups
            last_push_load_s=end - put,
            last_push_kind=kind,
            last_push_transport=transport,
            last_push_group_generation=channel.generation,
            last_push_group_formed=channel.generation != generation,
        )
        self.spans.add(
            "weight push", "weights", began, end, version=version, kind=kind, transport=transport
        )
        return expected

    def _broadcast_backend(self, tensors: dict[str, torch.Tensor]) -> Backend:
        """NCCL from CUDA tensors into workers that have GPUs; gloo otherwise."""
        on_cuda = any(t.device.type == "cuda" for t in tensors.values())
        return "nccl" if on_cuda and self.gpus_per_worker > 0 else "gloo"

    def _broadcast_channel(self) -> BroadcastChannel:
        """The store server and group, made on first use: on 127.0.0.1 for a local Ray, on this
        node's address when the workers run on a cluster (``ray_address``)."""
        if self._channel is None:
            import ray

            host = ray.util.get_node_ip_address() if self.ray_address else "127.0.0.1"
            self._channel = BroadcastChannel(host, self.broadcast_timeout_s)
        return self._channel

    def _close_broadcast(self) -> None:
        """Leave the weight group and stop serving its store (at shutdown)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _after_failed_broadcast(
        self, calls: list[tuple[Slot, int, Any]], weights: list[Any], version: int, keep: Any
    ) -> list[tuple[Slot, int, Any]]:
        """The calls that complete a push whose broadcast failed: a worker whose receive
        completed keeps it, a dead or hung one is left to :meth:`_collect` (which restarts it
        onto the object-store copy), and every other worker loads that copy."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        receiving = {slot.index: (incarnation, call) for slot, incarnation, call in calls}
        deadline = time.monotonic() + self.broadcast_timeout_s + 5.0
        completed = []
        for slot in self._slots:
            if slot.index in receiving:
                incarnation, call = receiving[slot.index]
                try:  # its receive fails once the group is gone (at most the group's timeout)
                    ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
                    completed.append((slot, incarnation, call))  # it got everything
                    continue
                except (RayActorError, GetTimeoutError):
                    completed.append((slot, incarnation, call))
                    continue
                except Exception:  # noqa: BLE001 - its receive failed: load the copy instead
                    pass
            load = slot.actor.load_weights.remote(weights, version, keep)
            completed.append((slot, slot.incarnation, load))
        return completed

    def push_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> str:
        """Send only a LoRA adapter payload (:mod:`periodic_rl.weight_sync.export`); every worker
        merges it into the base of the last :meth:`push_weights` (which must have had ``keep``)
        and is checked against :func:`adapter_fingerprint`, which is returned."""
        import ray

        self._require_started()
        self.weights_will_change()
        base = self._pushed
        if base is None or base.keep is None or not self._weights_ok:
            raise RuntimeError("push_adapter needs a successful push_weights(..., keep=...) first")
        self._settle_all()
        began = time.time()
        adapter = {name: t.detach().cpu() for name, t in adapter.items()}
        expected = adapter_fingerprint(base.base_fingerprint, adapter)
        ref = ray.put(to_payload(adapter))
        put = time.time()
        calls = [
            (s, s.incarnation, s.actor.load_adapter.remote([ref], version)) for s in self._slots
        ]
        target = replace(base, version=version, adapter=ref)
        self._collect(calls, target, expected, f"adapter push of version {version}")
        end = time.time()
        self.timings.update(
            last_push_s=end - began,
            last_push_put_s=put - began,
            last_push_hash_done_s=put - began,  # hashed before the put: the payload is small
            last_push_load_s=end - put,
            last_push_kind="adapter",
        )
        self.spans.add("weight push", "weights", began, end, version=version, kind="adapter")
        return expected

    # ---- shared memory (workers on this machine) ----------------------------------------------
    def _shared_push(
        self, state_dict: dict[str, torch.Tensor], keep: list[str] | None
    ) -> SharedPush | None:
        """A full push to workers on this machine (a Ray started here) by shared memory
        (:mod:`periodic_rl.weight_sync.shared_memory`), unless switched off or impossible."""
        if keep is not None or self.ray_address is not None or not shared_memory_enabled():
            return None
        return share(state_dict)

    def _copy_for_restarts(
        self, state_dict: dict[str, torch.Tensor], pushed: PushedWeights
    ) -> None:
        """Have a copy of a shared-memory push put into the object store, for workers restarted
        after the trainer's weights moved on; until it is there, a restart reads the shared
        memory. The copy starts once the next generation is dispatched
        (:meth:`_start_restart_copy`; started at once, its memory copies on this process's
        cores delayed that dispatch), and :meth:`weights_will_change` completes it."""
        self._restart_copy = _RestartCopy(state_dict, pushed)

    def _start_restart_copy(self) -> None:
        """Start putting the pending restart copy, in the background (this process only waits
        for the generation now)."""
        import ray

        pending = self._restart_copy
        if pending is None or pending.put is not None:
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="weights-restart-copy")
        state_dict = pending.state_dict
        pending.put = self._copier.submit(lambda: ray.put(to_payload(state_dict)))

    def weights_will_change(self) -> None:
        """The trainer is about to change the weights it pushed last (an optimizer step), or
        a worker restarts: their copy for restarted workers is completed first, and from then
        on restarts load it. Called by the strategy before every optimizer step, before every
        push and before every restart outside a push."""
        import ray

        pending, self._restart_copy = self._restart_copy, None
        if pending is None:
            return
        if pending.put is not None:
            ref = pending.put.result()
        else:
            ref = ray.put(to_payload(pending.state_dict))
        if self._pushed is pending.pushed:  # still what the workers hold
            self._pushed = replace(pending.pushed, base=ref)

    def _close_copier(self) -> None:
        self._restart_copy = None
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def worker_load_timings(self) -> list[dict[str, float]]:
        """Every worker's seconds of its last weight load, in worker order
        (:meth:`~periodic_rl.rollout.workers.worker.RolloutWorker.load_timings`: fetching the
        payload, the engine's reload and fingerprint); for benchmarks, one round trip per worker."""
        import ray

        self._require_started()
        return ray.get([slot.actor.load_timings.remote() for slot in self._slots])

    def _settle_all(self) -> None:
        for slot in self._slots:
            self._settle(slot, expected=self.fingerprint if self._weights_ok else None)

    def _collect(
        self, calls: list[tuple[Slot, int, Any]], target: PushedWeights, expected: str, what: str
    ) -> None:
        """Wait for every worker's load, restarting the dead straight onto ``target``; on
        success ``target`` becomes the current pushed weights (the previous push's objects
        are released), else raise naming the mismatches."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        got: dict[int, str] = {}
        self._pushed = target  # what any worker restarted from here on must load
        began = time.monotonic()  # every load was sent just now: one deadline for all
        try:
            for slot, incarnation, call in calls:
                timeout = self.call_timeout_s
                if timeout is not None:
                    timeout = max(0.0, began + timeout - time.monotonic())
                try:
                    got[slot.index] = ray.get(call, timeout=timeout)
                except RayActorError as error:  # restart it straight onto the new weights
                    self._restart(slot, incarnation, error, target)
                    got[slot.index] = self._settle(slot, expected=None)
                except GetTimeoutError:  # hung: killed, then the same
                    waited = time.monotonic() - began
                    self._restart_hung(slot, waited, "weight load", target)
                    got[slot.index] = self._settle(slot, expected=None)
        except BaseException:  # a load raised: the workers' weights are unknown now
            self._weights_ok, self._pushed = False, None
            raise
        del calls
        bad = {i: fp for i, fp in got.items() if fp != expected}
        if bad:
            self._weights_ok, self._pushed = False, None
            details = ", ".join(
                f"worker {i} (pid {self._slots[i].info.get('pid')}) reported {fp}"
                for i, fp in sorted(bad.items())
            )
            raise RuntimeError(f"{what} failed: expected fingerprint {expected}, {details}")
        self.version, self.fingerprint, self._weights_ok = target.version, expected, True


def _host_copy_and_fingerprint(
    tensors: dict[str, torch.Tensor], plan: BroadcastPlan
) -> tuple[dict[str, torch.Tensor], str]:
    """A host copy of ``tensors`` (none for CPU tensors; tied names share one copy, as in the
    broadcast) and its :func:`weights_fingerprint`, the one every worker must report."""
    host = {name: t.cpu() for name, t in tensors.items() if name not in plan.aliases}
    for name, target in plan.aliases.items():
        host[name] = host[target]
    host = {name: host[name] for name in tensors}
    return host, weights_fingerprint(host)
