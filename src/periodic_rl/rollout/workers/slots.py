"""The bookkeeping records of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from periodic_rl.rollout.types import GroupJob


@dataclass
class Slot:
    """One worker position: its cores survive restarts, its actor does not."""

    index: int
    cores: list[int] | None
    actor: Any = None
    incarnation: int = 0
    in_flight: int = 0
    restarts: int = 0
    failures: int = 0  # deaths and hangs since this slot last returned a call
    ready: Any = None  # ObjectRef of a restarted actor's warm_up; None when it can take work
    info: dict[str, Any] = field(default_factory=dict)
    last_done: float = 0.0  # time.monotonic() when a call of this actor was last seen done


@dataclass
class Call:
    """One ``generate`` call in flight: which slot (and which of its actors) runs which jobs."""

    slot: int
    incarnation: int
    jobs: list[GroupJob]
    sent: float = 0.0  # time.monotonic() at dispatch


class WorkerHungError(RuntimeError):
    """A worker returned nothing within ``call_timeout_s``: it is killed and restarted like a
    dead one (its calls sent again with the same seeds)."""


@dataclass(frozen=True)
class PushedWeights:
    """What a (re)started worker must load to hold the workers' current weights: the last full
    push (and the names it kept for adapter pushes), then the last adapter push on top of it.

    The object references keep both pushes in Ray's object store until they are replaced.
    """

    base: Any  # ObjectRef of the last full push's payload, or its SharedPush until that is put
    version: int
    base_fingerprint: str
    keep: list[str] | None = None  # names kept for adapter pushes; None: no adapter pushes
    adapter: Any = None  # ObjectRef of the last adapter push on this base, or None

    def warm_up_args(self) -> tuple[Any, ...]:
        """The arguments of ``RolloutWorker.warm_up`` that replay these pushes."""
        adapter = [self.adapter] if self.adapter is not None else None
        return [self.base], self.version, self.keep, adapter


def hung_slots(
    slots: list[Slot], in_flight: dict[Any, Call], call_timeout_s: float | None
) -> list[tuple[Slot, float]]:
    """The workers whose oldest call has run past its timeout (``call_timeout_s`` per group,
    from its dispatch or the worker's previous result, whichever is later) with nothing of
    theirs ready; each with how long that call has been waited for."""
    if call_timeout_s is None:
        return []
    import ray

    now = time.monotonic()
    calls: dict[int, list[tuple[Any, Call]]] = {}
    for ref, call in in_flight.items():
        slot = slots[call.slot]
        if call.incarnation == slot.incarnation and slot.ready is None:
            calls.setdefault(call.slot, []).append((ref, call))
    hung = []
    for index, mine in calls.items():
        slot = slots[index]
        oldest = min((call for _, call in mine), key=lambda call: call.sent)
        waited = now - max(oldest.sent, slot.last_done)
        if waited <= call_timeout_s * len(oldest.jobs):
            continue
        done, _ = ray.wait([ref for ref, _ in mine], timeout=0, fetch_local=False)
        if not done:  # a result not yet taken is progress, not a hang
            hung.append((slot, waited))
    return hung


class SlotOwner:
    """What the halves of :class:`~periodic_rl.rollout.workers.rollouts.RayRollouts` (its weight
    pushes and its streamed generation, both mixins) need from the class that owns the worker
    slots: the slots, the pushed weights' state, and starting and restarting workers."""

    _slots: list[Slot]
    _weights_ok: bool
    version: int | None
    fingerprint: str | None
    call_timeout_s: float | None

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
