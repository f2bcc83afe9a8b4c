"""`HardwareTuning`: the seam between a run and the tuning of the hardware it runs on.

A tuner acts at named moments of a run: before the strategy's set-up, between iterations, while
the trainer trains with generation done, before a weight push, and while a worker loads one. The
strategy and the rollout controller call these hooks and import no tuning module; the base class
does nothing at each of them (the default on GPUs, where devices are placed by Lightning and
Ray). :mod:`periodic_rl.cpu_tuning` is the tuner for CPU runs (which cores each side gets,
lending idle cores, the engine's dtype, the heap, thread counts); :func:`default_tuning` chooses
it for a run that trains on the CPU, and never on CUDA.

A tuner changes what it may through :class:`TunedRun` (the strategy): the controller's ``overlap``
and workers' cores between iterations, the engine's dtype before the engines start, the loggers.
The update never depends on it: a tuned run trains exactly as an untuned one, only faster or
slower.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

#: The tuner a run gets when none is given, by the training device's type.
DEFAULT_TUNING = {"cpu": "periodic_rl.cpu_tuning:CPUTuning"}


class RolloutSide(Protocol):
    """What a tuner may read and change of the rollout side (the controller)."""

    overlap: bool
    worker_cores: list[list[int]] | None

    @property
    def options(self) -> Any: ...  # RolloutOptions (frozen)

    @property
    def spans(self) -> Any: ...  # the run's SpanRecorder

    def set_worker_cores(self, worker_cores: list[list[int]]) -> None: ...

    def set_engine_dtype(self, dtype: str) -> None: ...


class TunedRun(Protocol):
    """What a tuner may read and change of the run (implemented by the periodic-async
    strategies)."""

    @property
    def rollouts(self) -> RolloutSide: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def lightning_module(self) -> Any: ...  # the RLModule: its model_path and trainer


class WorkerTuning:
    """A tuner's part inside each rollout worker (pickled to it): what a worker does while it
    loads a weight push. No-op."""

    def weight_load(self, borrowed: Iterable[int] | None) -> AbstractContextManager[object]:
        """The context a weight load runs in; ``borrowed``: the waiting trainer's cores
        (:meth:`HardwareTuning.weight_load_cores`)."""
        return nullcontext()


class HardwareTuning:
    """No tuning: every hook does nothing. Subclass it and override the moments you act at."""

    # ---- the strategy's moments -----------------------------------------------------------------
    def configure(self, run: TunedRun) -> None:
        """When the strategy is built: refuse what cannot be applied, choose the start."""

    def before_setup(self, run: TunedRun) -> None:
        """Before the strategy's set-up (the engines not started yet)."""

    def engine_dtype(self, run: TunedRun) -> str | None:
        """The engine's dtype for ``engine_dtype: auto`` (rank 0; None: the device's
        default)."""
        return None

    def after_setup(self, run: TunedRun) -> None:
        """The engines started and hold the first weights."""

    def between_iterations(self, run: TunedRun) -> None:
        """Before an iteration (after the previous one's weights were published)."""

    def teardown(self) -> None:
        """After the run (the engines shut down)."""

    # ---- the rollout pipeline's moments (the trainer's thread) ----------------------------------
    def while_training(self, generation_done: Callable[[], bool]) -> AbstractContextManager[object]:
        """The context a micro-batch trains in; ``generation_done()``: whether the workers
        have nothing left to generate now."""
        return nullcontext()

    def generation_done(self) -> None:
        """Every group of the iteration was generated; the trainer still trains."""

    def before_push(self) -> None:
        """The workers are about to load weights and generate again."""

    # ---- the workers' moments -------------------------------------------------------------------
    def weight_load_cores(self) -> list[int] | None:
        """Cores a worker may borrow while it loads a push (the waiting trainer's), or None."""
        return None

    def worker_tuning(self) -> WorkerTuning:
        """What each rollout worker runs its weight loads in."""
        return WorkerTuning()


def default_tuning(device: torch.device) -> HardwareTuning:
    """The tuner of a run training on ``device`` that names none: the CPU tuner on the CPU
    (imported by name here, so that a GPU run never imports it), else no tuning."""
    path = DEFAULT_TUNING.get(device.type)
    if path is None:
        return HardwareTuning()
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)()
