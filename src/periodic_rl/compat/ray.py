"""Ray internals the rollout workers rely on (checked on ray 2.60.0).

Pinned by ``tests/compat/test_ray.py``.
"""

from __future__ import annotations

import os

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
