"""Ray internals the rollout workers rely on (checked on ray 2.60.0).

Pinned by ``tests/compat/test_ray.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

#: Ray's internal configuration variable for ``RayConfig::worker_niceness``
#: (``ray._private.ray_constants.RAY_WORKER_NICENESS``).
WORKER_NICENESS_VARIABLE = "RAY_worker_niceness"


def set_default_worker_niceness(niceness: int = 0) -> None:
    """Have the local Ray started next renice its worker processes by ``niceness`` instead of
    its default 15 (unless the user set the variable).

    Relies on the internal configuration variable ``RAY_worker_niceness`` (ray 2.60.0:
    ``RayConfig::worker_niceness``, read from the environment when the raylet starts; Ray's job
    manager sets it the same way), so call this before ``ray.init``.
    """
    os.environ.setdefault(WORKER_NICENESS_VARIABLE, str(niceness))


def actor_failed_in_init(error: BaseException) -> bool:
    """Whether ``error`` (raised by a call to an actor) says the actor died in its constructor
    (so starting it again would fail again), not later.

    Relies on the undocumented property ``RayActorError.actor_init_failed`` (ray 2.60.0: true
    for the ``ActorDiedError`` of an actor whose ``__init__`` raised).
    """
    return bool(getattr(error, "actor_init_failed", False))


#: Ray's switch between a cluster-reachable node address and the loopback one
#: (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``; false by default only on Windows/macOS).
CLUSTER_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def loopback_node() -> Iterator[None]:
    """Within this block, a local ``ray.init`` gives its node the address 127.0.0.1, so that
    every server of the cluster (GCS, raylet, object manager, workers, runtime-env agent)
    listens on loopback only.

    Ray resolves ``127.0.0.1`` (also when passed as ``_node_ip_address``) to the machine's
    routable address unless cluster mode is off, which it is by default only on Windows and
    macOS; its gRPC servers then bind to all interfaces. Relies on two internals of ray 2.60.0:
    ``ray_constants.ENABLE_RAY_CLUSTER``, read by ``services.get_node_ip_address`` at call time,
    and the environment variable it comes from, inherited by the raylet and its workers. Both
    are restored afterwards, so a later ``ray.init`` that joins a real cluster is unaffected.
    """
    from ray._private import ray_constants

    saved_env = os.environ.get(CLUSTER_VARIABLE)
    saved = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[CLUSTER_VARIABLE] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(CLUSTER_VARIABLE, None)
        else:
            os.environ[CLUSTER_VARIABLE] = saved_env
