"""Reward calls in worker processes that a timeout can stop: :class:`RewardPool`.

A reward call that runs in the trainer's process holds its GIL, and one that never returns can
only be abandoned (Python cannot stop a thread). The pool runs each call in a worker process
of a `pebble <https://pebble.readthedocs.io>`_ ``ProcessPool`` instead: the trainer's GIL stays
free, and a call past ``reward_timeout_s`` is stopped by killing its worker (a fresh one takes
its place).

Which rewards run in the pool (:func:`runs_in_pool`): those that can be sent to another
process by reference or by value, i.e. that ``pickle`` accepts: module-level functions (the
``package.module:function`` paths of ``reward_funcs``), ``functools.partial`` of them, and
small callable objects such as :class:`~periodic_rl.remote_rewards.HTTPReward`. These stay in
the trainer's process, in a thread as before (a timeout abandons them, it cannot stop them):
the module's own ``reward()`` override and other bound methods (they carry their object, the
whole training module), lambdas and functions defined inside functions (``pickle`` refuses
them), and objects that declare ``reward_in_process = True``
(:class:`~periodic_rl.rewards.RewardModel`: a model on a device). A pooled reward runs in
another process: what it changes in its own module's globals is not seen by the trainer.

The workers start at the first call (once per fit: the set-up check of the rewards is usually
that call) and are stopped by :meth:`RewardPool.close` at the end of the fit; a worker whose
trainer process is gone exits by itself. On Linux the workers are forked (no re-import of the
trainer's modules: a start costs milliseconds); elsewhere they are spawned.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from periodic_rl.rewards import RewardError, RewardTimeoutError, reward_name

PARENT_CHECK_S = 1.0  # how often a worker checks that its trainer process is still there

_FUNCS: dict[str, Callable[..., Any]] = {}  # in a worker: the pooled rewards, by name


def runs_in_pool(func: Callable[..., Any]) -> bool:
    """Whether ``func`` can run in a worker process (see the module's docstring for the rule)."""
    if getattr(func, "reward_in_process", False) or inspect.ismethod(func):
        return False
    try:
        pickle.dumps(func)
    except Exception:  # noqa: BLE001 - PicklingError, AttributeError, TypeError: all mean no
        return False
    return True


def check_reward_workers(workers: Any) -> None:
    """Refuse a bad ``reward_workers`` (at construction)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(
            f"reward_workers must be an integer >= 0 (worker processes for the reward calls; "
            f"0 runs them in the trainer's process), got {workers!r}"
        )


class RewardPool:
    """``workers`` processes that run the calls of the pooled rewards among ``funcs``."""

    def __init__(self, funcs: Sequence[Callable[..., Any]], workers: int) -> None:
        check_reward_workers(workers)
        self.workers = workers
        self.pooled = {
            reward_name(f): f for f in funcs if workers > 0 and runs_in_pool(f)
        }  # fmt: skip
        self._pool: ProcessPool | None = None
        self._lock = threading.Lock()

    def runs(self, name: str) -> bool:
        """Whether the reward ``name`` runs in the pool (else in the trainer's process)."""
        return name in self.pooled

    def call(
        self,
        name: str,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        timeout_s: float | None,
    ) -> Any:
        """``reward(prompts, completions, **columns)`` in a worker: its return value, its
        exception, or :class:`RewardTimeoutError` once its worker was killed at ``timeout_s``."""
        future = self._started().schedule(
            _call_in_worker, args=(name, prompts, completions, columns), timeout=timeout_s
        )
        try:
            return future.result()
        except FutureTimeout as error:
            raise RewardTimeoutError(
                f"reward '{name}' did not return within {timeout_s} s (its process was stopped)"
            ) from error
        except ProcessExpired as error:
            raise RewardError(
                f"the process running reward '{name}' died (exit code {error.exitcode}) during "
                "the call"
            ) from error

    def close(self) -> None:
        """Stop the workers (a call still running is killed) and wait for them."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def _started(self) -> ProcessPool:
        with self._lock:
            if self._pool is None:
                method = "fork" if sys.platform == "linux" else "spawn"
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    initializer=_init_worker,
                    initargs=(self.pooled, os.getpid()),
                    context=multiprocessing.get_context(method),
                )
            return self._pool


def _init_worker(funcs: dict[str, Callable[..., Any]], parent: int) -> None:
    """In a new worker: keep the rewards, and exit once the trainer process is gone."""
    _FUNCS.clear()
    _FUNCS.update(funcs)

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="periodic-rl-parent-watch", daemon=True).start()


def _call_in_worker(
    name: str, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
) -> Any:
    return _FUNCS[name](prompts, completions, **columns)
