"""Where the rollout workers run: the Ray cluster they join, and their placement group.

Ray is started only by :meth:`~periodic_rl.rollout.workers.rollouts.RayRollouts.start` (the
strategy's setup, never at import), locally unless ``ray_address`` is given
(:func:`init_ray`). A local cluster listens on loopback only: no dashboard, and its node gets
the address 127.0.0.1 (:func:`~periodic_rl.compat.ray.loopback_node`), so Ray's servers bind to
127.0.0.1 (the engines open no listening socket of their own). A ``ray_address`` on loopback
(a cluster started with ``--node-ip-address=127.0.0.1``) is joined on loopback too: otherwise
Ray rewrites 127.0.0.1 into the machine's routable address, where nothing listens. To be
reachable from other machines, join a cluster you started (``ray_address``) or give
``ray_init_kwargs={"_node_ip_address": ...}``.

Placement: the workers reserve one Ray placement group with one bundle per worker (its CPUs,
GPUs and custom resources such as ``{"rollout": 1}``), placed by the strategy asked for
(``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``). Worker ``i`` always runs in bundle
``i``: a restarted worker lands on the node its predecessor had, holding the same reservation,
so a restart can neither wait for resources another job took nor move a worker elsewhere.
A group that cannot be placed fails :meth:`WorkerPlacement.reserve` with what was asked for and
what each node offers, instead of leaving the workers pending forever.
"""

from __future__ import annotations

import ipaddress
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from periodic_rl import ROLLOUT_WORKER_ENV
from periodic_rl.compat.ray import loopback_node, set_default_worker_niceness
from periodic_rl.rollout.processes import all_cores, visible_gpus

__all__ = [
    "PlacementError",
    "WorkerPlacement",
    "init_ray",
    "node_label",
    "ray_init_args",
    "this_node",
    "worker_bundle",
    "worker_runtime_env",
]

_SRC_DIR = str(Path(__file__).resolve().parents[3])  # .../src, so workers import periodic_rl

#: How long a placement group may stay pending (resources busy elsewhere) before start fails.
PLACEMENT_TIMEOUT_S = 120.0
#: How long Ray may call a group infeasible (no node could ever hold a bundle) before start
#: fails; a short grace lets a node that is still joining (or an autoscaler) catch up.
INFEASIBLE_GRACE_S = 5.0


class PlacementError(RuntimeError):
    """The workers' placement group could not be placed on the cluster."""


def ray_init_args(ray_address: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The ``ray.init`` arguments: join ``ray_address``, or a new local, loopback-only Ray on
    every core of this machine (never a stray cluster from ``RAY_ADDRESS`` or ``ray start``)."""
    if ray_address:
        return {"address": ray_address, **overrides}
    args: dict[str, Any] = {
        "address": "local",
        "num_cpus": os.cpu_count() or 1,
        "include_dashboard": False,
        "dashboard_host": "127.0.0.1",
    }
    args.update(overrides)
    return args


def on_loopback(address: str | None) -> bool:
    """Whether a ``host:port`` Ray address names this machine's loopback interface."""
    if not address or address in ("auto", "local"):
        return False
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def init_ray(args: dict[str, Any], local_gpus: list[int] | None) -> None:
    """``ray.init(**args)``: a local Ray (``address="local"``) on loopback, on every core, with
    only ``local_gpus``; a cluster on a loopback address joined on loopback."""
    import ray

    # Ray renices workers to 15 by default; a rollout worker is half of the pipeline, not
    # background work, and must not yield its core to anything else.
    set_default_worker_niceness(0)
    local = "_node_ip_address" not in args and args.get("address") == "local"
    loopback = local or ("_node_ip_address" not in args and on_loopback(args.get("address")))
    gpus = visible_gpus(local_gpus) if local else nullcontext()
    with all_cores(), gpus, loopback_node() if loopback else nullcontext():
        ray.init(**args)


def worker_runtime_env(pythonpath: list[str], env_vars: dict[str, str]) -> dict[str, Any]:
    """Per-actor runtime env: ``PYTHONPATH`` so the actor and vLLM's own worker processes
    (which inherit the actor's environment) can import this package and the user's code, on
    whichever node the actor runs; ``ROLLOUT_WORKER_ENV`` so that importing the package there
    does not import Lightning (a worker only generates)."""
    paths = [_SRC_DIR, *pythonpath]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths.append(os.getcwd())
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), ROLLOUT_WORKER_ENV: "1"}
    env.update(env_vars)
    return {"env_vars": env}


def worker_bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """The resources one worker reserves: its CPUs, its GPUs (if any) and custom resources."""
    bundle = {"CPU": float(cpus)}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    bundle.update({name: float(amount) for name, amount in resources.items()})
    return {name: amount for name, amount in bundle.items() if amount > 0}


def this_node() -> dict[str, str]:
    """The Ray node id and IP address of the calling process (Ray must be initialised)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
    }


def node_label(lane: str, info: dict[str, Any]) -> str:
    """A timeline lane's label with the node it runs on, e.g. ``worker-0 @ node 3f2a9c1e
    (10.0.0.2)`` (the first 8 hex digits of the Ray node id)."""
    node = info.get("node_id")
    return f"{lane} @ node {node[:8]} ({info.get('node_ip')})" if node else lane


class WorkerPlacement:
    """One placement group holding a bundle per worker; see the module docstring."""

    def __init__(self, group: Any, bundles: list[dict[str, float]], strategy: str) -> None:
        self.group, self.bundles, self.strategy = group, bundles, strategy

    @classmethod
    def reserve(
        cls,
        bundles: list[dict[str, float]],
        strategy: str,
        timeout_s: float = PLACEMENT_TIMEOUT_S,
        infeasible_s: float = INFEASIBLE_GRACE_S,
    ) -> WorkerPlacement:
        """Create the group and wait until every bundle is placed; raise
        :class:`PlacementError` (after removing it) if Ray finds it infeasible for
        ``infeasible_s`` or it is not placed within ``timeout_s``."""
        from ray.util.placement_group import placement_group

        placement = cls(placement_group(bundles, strategy=strategy), bundles, strategy)
        began = time.monotonic()
        while True:
            if placement.group.wait(timeout_seconds=1):
                return placement
            waited = time.monotonic() - began
            infeasible = placement.scheduling_state() == "INFEASIBLE"
            if (infeasible and waited >= infeasible_s) or waited >= timeout_s:
                placement.remove()
                raise PlacementError(placement.explain(infeasible, waited))

    def scheduling_state(self) -> str | None:
        """Ray's scheduling state of the group (``INFEASIBLE``: no node could hold a bundle)."""
        from ray.util.placement_group import placement_group_table

        return placement_group_table(self.group).get("stats", {}).get("scheduling_state")

    def explain(self, infeasible: bool, waited: float) -> str:
        """Why the group is not placed, what each node offers, and what to change."""
        import ray

        asked = f"{len(self.bundles)} x {self.bundles[0]}"
        why = (
            "no node of the cluster can hold a worker's bundle (infeasible)"
            if infeasible
            else f"not placed after {waited:.0f} s (resources held by others?)"
        )
        nodes = "; ".join(
            f"node {n['NodeID'][:8]} ({n['NodeManagerAddress']}): {_public(n['Resources'])}"
            for n in ray.nodes()
            if n.get("Alive")
        )
        return (
            f"the rollout workers' placement group ({self.strategy}, one bundle per worker: "
            f"{asked}) cannot be placed: {why}. The cluster has {_public(ray.cluster_resources())}"
            f", available {_public(ray.available_resources())}; its nodes: {nodes}. Fix: start "
            "nodes that offer these resources (ray start --resources='{\"rollout\": 1}' ...), "
            "or lower num_workers, cpus_per_worker, gpus_per_worker or worker_resources, or "
            "use a looser placement_strategy (PACK or SPREAD instead of a STRICT_ one)."
        )

    def options(self, index: int) -> dict[str, Any]:
        """Actor options that run worker ``index`` in its own bundle (its child processes and
        tasks, such as vLLM's, are not captured into the group)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=False,
        )
        return {"scheduling_strategy": strategy}

    def remove(self) -> None:
        """Release the reservation (best effort: Ray may already be down)."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - nothing left to release
            pass


def _public(resources: dict[str, float]) -> dict[str, float]:
    """Resources without Ray's per-node and per-placement-group bookkeeping entries."""
    return {
        name: round(amount, 3)
        for name, amount in sorted(resources.items())
        if not name.startswith("node:")
        and "_group_" not in name
        and name not in ("memory", "object_store_memory")
    }
