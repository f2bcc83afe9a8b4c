"""Weight pushes of :class:`~periodic_rl.rollout.ray_rollouts.RayRollouts`: full and LoRA adapter.

A full push sends a state dict (one ``ray.put``) that every worker loads and fingerprints; with
``keep`` (the LoRA-adapted names) the workers also keep their base weights, and from then on
:meth:`WeightPushes.push_adapter` sends only the adapter factors
(:func:`~periodic_rl.weight_sync.export.lora_adapter_payload`), which every worker merges into
its kept base (:mod:`periodic_rl.weight_sync.merge`). Either way every worker's reported
fingerprint is checked against the one computed here, and a worker that dies during a push, or
whose load does not return within ``call_timeout_s`` (it is killed), is restarted straight onto
the pushed weights (base and adapter replayed).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from periodic_rl.rollout.ray_slots import PushedWeights, Slot
from periodic_rl.weight_sync.fingerprint import adapter_fingerprint, weights_fingerprint
from periodic_rl.weight_sync.transport import to_payload

if TYPE_CHECKING:
    from periodic_rl.rollout.timing import SpanRecorder


class WeightPushes:
    """The weight-push half of :class:`~periodic_rl.rollout.ray_rollouts.RayRollouts` (a mixin:
    the class it is mixed into owns the state it uses)."""

    _slots: list[Slot]
    _pushed: PushedWeights | None
    _weights_ok: bool
    version: int | None
    fingerprint: str | None
    call_timeout_s: float | None
    timings: dict[str, Any]
    spans: SpanRecorder

    def _require_started(self) -> None:
        raise NotImplementedError

    def _settle(self, slot: Slot, expected: str | None) -> str:
        raise NotImplementedError

    def _restart(
        self, slot: Slot, incarnation: int, error: BaseException, weights: Any = ...
    ) -> None:
        raise NotImplementedError

    def _restart_hung(self, slot: Slot, waited: float, what: str, weights: Any = ...) -> None:
        raise NotImplementedError

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

        self._require_started()
        self._settle_all()
        began = time.time()
        state_dict = {name: t.detach().cpu() for name, t in state_dict.items()}  # once, if on GPU
        keep = sorted(keep) if keep is not None else None
        if keep is not None and not set(keep) <= state_dict.keys():
            raise KeyError(
                f"keep names weights not pushed: {sorted(set(keep) - state_dict.keys())}"
            )
        # Hash here while the workers load (xxhash releases the GIL on large buffers).
        with ThreadPoolExecutor(1, thread_name_prefix="weights-fingerprint") as pool:
            hashing = pool.submit(weights_fingerprint, state_dict)
            ref = ray.put(to_payload(state_dict))
            put = time.time()
            calls = [
                (s, s.incarnation, s.actor.load_weights.remote([ref], version, keep))
                for s in self._slots
            ]
            expected = hashing.result()
            hashed = time.time()
        target = PushedWeights(ref, version, expected, keep)
        kind = "full" if keep is None else "base"
        self._collect(calls, target, expected, f"weight push of version {version}")
        end = time.time()
        self.timings.update(
            last_push_s=end - began,
            last_push_put_s=put - began,
            last_push_hash_done_s=hashed - began,  # the hash overlaps the put and the loads
            last_push_load_s=end - put,
            last_push_kind=kind,
        )
        self.spans.add("weight push", "weights", began, end, version=version, kind=kind)
        return expected

    def push_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> str:
        """Send only a LoRA adapter payload (:mod:`periodic_rl.weight_sync.export`); every worker
        merges it into the base of the last :meth:`push_weights` (which must have had ``keep``)
        and is checked against :func:`adapter_fingerprint`, which is returned."""
        import ray

        self._require_started()
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
