"""The trainer's side of the weight group of :class:`~periodic_rl.rollout.workers.rollouts.
RayRollouts` (``push_transport="broadcast"``; :mod:`periodic_rl.weight_sync.broadcast`).

:class:`BroadcastChannel` serves the group's store and forms the group: the trainer is rank 0,
worker ``i`` rank ``i + 1``. A group is kept while the workers it was formed with live; a
worker restarted since (a new actor: its slot's ``incarnation`` changed) or a failed broadcast
makes the next push form a new generation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from periodic_rl.rollout.workers.slots import Slot
from periodic_rl.weight_sync.broadcast import Backend, GroupAddress, StoreServer, WeightGroup


class BroadcastFailedError(RuntimeError):
    """The weight group could not be formed, or a broadcast through it failed."""


class BroadcastChannel:
    """The trainer's store server and its current weight group.

    Args:
        host: the address the store and the trainer's gloo connections bind to: 127.0.0.1 for
            a local run, the trainer node's address when the workers are on a cluster.
        timeout_s: the group's timeout: forming it, and every collective.
    """

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.generation = 0  # groups formed so far
        self._server: StoreServer | None = None
        self._group: WeightGroup | None = None
        self._members: tuple[Any, ...] | None = None
        #: Why broadcasting cannot work here (a worker on the trainer's own GPU), once found.
        self.unusable: str | None = None

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    def group_for(self, slots: Sequence[Slot], backend: Backend) -> WeightGroup:
        """The group of these workers' current actors, formed (as a new generation) unless the
        current one is it; raises :class:`BroadcastFailedError` if a worker does not join
        within the timeout (or dies meanwhile)."""
        members = (backend, *((s.index, s.incarnation) for s in slots))
        group = self._group
        if group is not None and group.backend is not None and members == self._members:
            return group
        self.close_group()
        if self._server is None:
            self._server = StoreServer(self.host, timeout_s=self.timeout_s)
        self.generation += 1
        address = GroupAddress(
            self._server.host,
            self._server.port,
            len(slots) + 1,
            self.generation,
            backend,
            self.timeout_s,
        )
        joins = [s.actor.join_weight_group.remote(address, s.index + 1) for s in slots]
        group = self._join(address, joins)
        mine = group.device_uuid()
        if mine is not None:
            import ray

            shared = [
                s.index for s, uuid in zip(slots, ray.get(joins), strict=True) if uuid == mine
            ]
            if shared:
                group.close()
                self.unusable = (
                    f"rollout worker(s) {shared} use the trainer's own GPU: ranks of one NCCL "
                    "group need a GPU each"
                )
                raise BroadcastFailedError(self.unusable)
        self._group, self._members = group, members
        return group

    def close_group(self) -> None:
        """Leave the current group (the workers' collectives on it then fail)."""
        group, self._group, self._members = self._group, None, None
        if group is not None:
            group.close()

    def close(self) -> None:
        """Leave the group and stop serving the store."""
        self.close_group()
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def _join(self, address: GroupAddress, joins: list[Any]) -> WeightGroup:
        """Join as rank 0 in a thread, watching the workers' joins: a worker that dies (or
        fails to join) ends the wait at once instead of at the group's timeout."""
        import ray

        assert self._server is not None
        done: dict[str, Any] = {}

        def join() -> None:
            try:
                done["group"] = WeightGroup.join(
                    address, 0, self.host, store=self._server.store if self._server else None
                )
            except BaseException as error:  # noqa: BLE001 - reported to the caller below
                done["error"] = error

        thread = threading.Thread(target=join, name="weight-group-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s + 5.0
        pending = list(joins)
        try:
            while pending or thread.is_alive():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not every member joined within {self.timeout_s:.0f} s")
                if pending:
                    ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
                    ray.get(ready)  # raises for a worker that died or could not join
                else:
                    thread.join(0.05)
            if "error" in done:
                raise done["error"]
        except BaseException as error:
            if thread.is_alive():  # it ends at the timeout; its group is dropped then
                threading.Thread(target=_drop_when_joined, args=(thread, done), daemon=True).start()
            else:
                _drop_when_joined(thread, done)
            raise BroadcastFailedError(
                f"the weight group (generation {address.generation}, {address.world_size} "
                f"members, {address.backend} on {address.host}:{address.port}) could not be "
                f"formed: {error}"
            ) from error
        return done["group"]


def _drop_when_joined(thread: threading.Thread, done: dict[str, Any]) -> None:
    thread.join()
    group = done.pop("group", None)
    if group is not None:
        group.close()
