"""Pins of :mod:`periodic_rl.compat.ray` (checked on ray 2.60.0), on a real local Ray.

The module starts one local Ray (1 CPU, no dashboard) with the worker niceness the adapter sets;
a Ray upgrade that changes an internal fails the test named after the adapter that uses it.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import ray
from ray.exceptions import RayActorError

from periodic_rl.compat.ray import (
    WORKER_NICENESS_VARIABLE,
    actor_failed_in_init,
    set_default_worker_niceness,
)

NICENESS = 3  # not Ray's default (15) nor 0: proves Ray read the variable


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray started after ``set_default_worker_niceness(NICENESS)``."""
    saved = os.environ.pop(WORKER_NICENESS_VARIABLE, None)
    if ray.is_initialized():  # left by another module: this one needs the variable at start
        ray.shutdown()
    try:
        set_default_worker_niceness(NICENESS)
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        os.environ.pop(WORKER_NICENESS_VARIABLE, None)
        if saved is not None:
            os.environ[WORKER_NICENESS_VARIABLE] = saved


def test_set_default_worker_niceness_keeps_a_value_the_user_set(monkeypatch):
    monkeypatch.setenv(WORKER_NICENESS_VARIABLE, "7")
    set_default_worker_niceness(0)
    assert os.environ[WORKER_NICENESS_VARIABLE] == "7"


def test_set_default_worker_niceness_renices_ray_workers_by_that_much(local_ray):
    """Guards the internal config variable ``RAY_worker_niceness`` (``RayConfig::
    worker_niceness``): the raylet started by ``ray.init`` renices each worker by its value."""

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    driver = os.nice(0)
    assert ray.get(niceness.remote(), timeout=120) == min(driver + NICENESS, 19)


def test_actor_failed_in_init_tells_a_constructor_failure_from_a_later_death(local_ray):
    """Guards ``RayActorError.actor_init_failed``: true for the error of a call to an actor
    whose ``__init__`` raised (RayRollouts then gives up instead of restarting it), false for an
    actor that died after it started."""

    @ray.remote(num_cpus=0, max_restarts=0)
    class Broken:
        def __init__(self) -> None:
            raise ValueError("the engine cannot be built")

        def ping(self) -> int:
            return 1

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
    class Healthy:
        def ping(self) -> int:
            return os.getpid()

    with pytest.raises(RayActorError) as failed:
        ray.get(Broken.remote().ping.remote(), timeout=120)
    assert actor_failed_in_init(failed.value)

    actor = Healthy.remote()
    pid = ray.get(actor.ping.remote(), timeout=120)
    # SIGKILL and wait until the process is gone (ray.kill is asynchronous: a call made right
    # after it may still run), so the next call surely meets a dead actor.
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=60)
    with pytest.raises(RayActorError) as died:
        ray.get(actor.ping.remote(), timeout=120)
    assert not actor_failed_in_init(died.value)
