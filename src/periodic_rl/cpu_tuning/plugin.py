"""`CPUTuning`: the hardware tuner of a run that trains on the CPU.

What it does, each at its moment of :class:`~periodic_rl.rollout.tuning.HardwareTuning`:

- before set-up: resolves ``engine_dtype: auto`` (:mod:`periodic_rl.cpu_tuning.engine_dtype`),
  starts ``worker_cores: auto`` on the split a run of this workload chose before
  (:mod:`periodic_rl.cpu_tuning.split_cache`), pins the trainer to ``trainer_cores``, and keeps
  freed memory in the process (:mod:`periodic_rl.cpu_tuning.heap`);
- between iterations: once a window of iterations is measured, logs the split that would
  balance generation and training (``split/*``) and, with ``worker_cores: auto``, applies it
  (:mod:`periodic_rl.cpu_tuning.split_advisor`);
- while the trainer trains with generation done, and before each push: lends the idle workers'
  cores to the trainer and takes them back (:mod:`periodic_rl.cpu_tuning.core_loan`); while a
  worker loads a push, it borrows the waiting trainer's cores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Literal

import torch

from periodic_rl.cpu_tuning.core_loan import LOAN_LANE, lend_once_ready
from periodic_rl.cpu_tuning.engine_dtype import DtypeChoice, resolve_engine_dtype
from periodic_rl.cpu_tuning.hardware_split import Candidate, SplitModel
from periodic_rl.cpu_tuning.heap import keep_freed_memory
from periodic_rl.cpu_tuning.split_advisor import (
    SplitAdvisor,
    auto_start,
    iterations_left,
    log_only_advisor,
)
from periodic_rl.cpu_tuning.split_cache import SplitCache, workload_of
from periodic_rl.rollout.engines.engine_checks import check_cores
from periodic_rl.rollout.processes import CoreLoan, repin_threads
from periodic_rl.rollout.tuning import HardwareTuning, TunedRun, WorkerTuning

log = logging.getLogger(__name__)


class CPUTuning(HardwareTuning):
    """Which CPU cores each side of the run gets, and when one lends its idle cores.

    Args:
        worker_cores: CPU cores to pin each rollout worker to (one list per worker), or
            ``auto``: start taking turns on all cores (``overlap`` is then chosen too), measure,
            and move to overlap on disjoint cores only where the measured rates predict it
            faster; after a window there, keep the faster split (one training process, local
            Ray, ``max_staleness: 0``; docs/scaling.md). The choice is remembered per machine
            and workload (``~/.cache/periodic_rl/hardware_split.json``, or
            ``$PERIODIC_RL_SPLIT_CACHE``): the next such run starts on it, exploring nothing.
        trainer_cores: CPU cores to pin each training process to (with ``worker_cores``, the
            two sides do not fight over cores; chosen by ``worker_cores: auto``).
        lend_idle_cores: with ``worker_cores`` and ``trainer_cores`` (or ``auto``) on one
            machine: once the workers have nothing left to generate, the trainer also uses
            their cores (from inside the micro-batch it is training) until the next push; while
            the trainer waits for a push, the workers load it on the trainer's cores as well.
            ``False``: each side keeps to its own cores throughout.
        split_after: iterations measured (after one of warm-up) before the run logs its
            generation and training rates and the split that would balance them (a log line;
            also ``split/*`` metrics when ``worker_cores`` is given); with ``worker_cores:
            auto``, per measured split.
    """

    def __init__(
        self,
        worker_cores: list[list[int]] | Literal["auto"] | None = None,
        trainer_cores: list[int] | None = None,
        lend_idle_cores: bool = True,
        split_after: int = 3,
    ) -> None:
        if isinstance(worker_cores, str) and worker_cores != "auto":
            raise ValueError(
                f"worker_cores must be lists of cores, 'auto' or null: {worker_cores!r}"
            )
        if split_after < 1:
            raise ValueError(f"split_after must be >= 1 iteration, got {split_after}")
        self.worker_cores = worker_cores
        self.trainer_cores = list(trainer_cores) if trainer_cores is not None else None
        self.lend_idle_cores = lend_idle_cores
        self.split_after = split_after
        self.split_start: Candidate | None = None  # worker_cores: auto's current split
        self.split_cache: SplitCache | None = None
        self.split_advisor: SplitAdvisor | None = None  # rank 0, from set-up
        self.engine_dtype_choice: DtypeChoice | None = None  # rank 0's, once resolved
        self.loan = CoreLoan()  # the workers' cores lent to the trainer
        self._machine_cores = sorted(os.sched_getaffinity(0))  # before any pinning
        self._run: TunedRun | None = None
        self._lendable: list[int] = []

    # ---- the strategy's moments -----------------------------------------------------------------
    def configure(self, run: TunedRun) -> None:
        """Refuse cores this machine does not offer and ``auto`` where it cannot apply; choose
        the starting split."""
        self._run = run
        rollouts, options = run.rollouts, run.rollouts.options
        if self.worker_cores == "auto":
            start = auto_start(
                options.num_workers,
                options.use_ray,
                options.ray_address,
                options.gpus_per_worker,
                options.staleness_bound,
                self.trainer_cores,
            )
            self.split_start = start
            self.trainer_cores = list(start.trainer_cores)
            rollouts.overlap = start.overlap
            rollouts.worker_cores = [list(cores) for cores in start.worker_cores]
        elif self.worker_cores is not None:
            if len(self.worker_cores) != options.num_workers:
                raise ValueError(
                    f"worker_cores has {len(self.worker_cores)} entries for "
                    f"num_workers={options.num_workers}"
                )
            if options.ray_address is None:  # a cluster's workers may run on other machines
                for i, cores in enumerate(self.worker_cores):
                    check_cores(cores, f"worker_cores[{i}]")
            rollouts.worker_cores = [list(cores) for cores in self.worker_cores]
        if self.trainer_cores is not None:
            check_cores(self.trainer_cores, "trainer_cores")

    def before_setup(self, run: TunedRun) -> None:
        self._run = run
        if self.split_start is not None:
            self._check_auto_device(run)
            self.split_cache = self._open_split_cache(run)
            hit = self.split_cache.hit
            if hit is not None:  # start on the split a run of this workload chose
                self.split_start, self.trainer_cores = hit.split, list(hit.split.trainer_cores)
                run.rollouts.overlap = hit.split.overlap
                run.rollouts.worker_cores = [list(cores) for cores in hit.split.worker_cores]
                log.info("hardware split: cached from %s: %s", hit.date, hit.describe())
        if self.trainer_cores:
            os.sched_setaffinity(0, set(self.trainer_cores))
            torch.set_num_threads(len(self.trainer_cores))
        keep_freed_memory()  # each step's large buffers reused, not page-faulted in again

    def engine_dtype(self, run: TunedRun) -> str | None:
        """``engine_dtype: auto`` (:mod:`periodic_rl.cpu_tuning.engine_dtype`), measured on the
        cores the first worker will run on: its ``worker_cores``, else as many of this
        process's cores as the threads Ray gives it (``cpus_per_worker``); without Ray, the
        trainer's (the engine runs in its process)."""
        options = run.rollouts.options
        cores = (run.rollouts.worker_cores or [[]])[0]
        if not options.use_ray:
            cores = self.trainer_cores or self._machine_cores
        if not cores:
            cores = self._machine_cores[: max(1, int(options.cpus_per_worker))]
        on_gpu = bool(options.gpus_per_worker)
        module = run.lightning_module
        choice = resolve_engine_dtype(options.engine, module.model_path, list(cores), on_gpu)
        self.engine_dtype_choice = choice
        trainer = module.trainer
        for logger in trainer.loggers:
            logger.log_metrics(choice.metrics(), step=trainer.global_step)
        return choice.dtype

    def after_setup(self, run: TunedRun) -> None:
        """The engines hold the first weights: the advisor starts measuring (rank 0)."""
        self.split_advisor = self._split_advisor(run)
        self._lendable = self._lendable_cores(run)

    def between_iterations(self, run: TunedRun) -> None:
        """Once a window of iterations is measured, log the rates and the split that would
        balance them (and, with ``worker_cores: auto``, apply it)."""
        advisor = self.split_advisor
        if advisor is None:
            return
        trainer = run.lightning_module.trainer
        step = advisor.step(run.rollouts.spans, iterations_left(trainer))
        if step is None:
            return
        if self.worker_cores is not None:  # a split in use: its metrics (a run without one
            # gets the advice in the log line below, not eleven columns of split/*).
            # To the loggers once per window (self.log from this hook was re-logged each step).
            metrics = step.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
        log.info("hardware split: %s%s", step.reason, "; applying it" if step.apply else "")
        if step.apply is not None:
            before = set(os.sched_getaffinity(0))
            repin_threads(list(step.apply.trainer_cores), before)
            self.trainer_cores = list(step.apply.trainer_cores)
            self.before_push()
            run.rollouts.overlap = step.apply.overlap  # read at each iteration's start
            run.rollouts.set_worker_cores([list(cores) for cores in step.apply.worker_cores])
            self._lendable = self._lendable_cores(run)
        if step.final and not step.deferred and self.split_cache is not None:  # auto
            if self.split_cache.hit is None:
                self.split_cache.remember(step, advisor.windows)
            else:
                self.split_cache.check(step)

    def teardown(self) -> None:
        self.before_push()

    # ---- core loans -----------------------------------------------------------------------------
    def while_training(self, generation_done: Callable[[], bool]) -> AbstractContextManager[object]:
        """Lend the workers' cores at the first point (a tensor autograd saves or reads back on
        this thread) where the workers have nothing left to generate."""
        cores = self._idle_cores()
        if not cores:
            return nullcontext()
        if generation_done():
            self.loan.lend(cores)
        return lend_once_ready(self.loan, cores, generation_done)

    def generation_done(self) -> None:
        cores = self._idle_cores()
        if cores:
            self.loan.lend(cores)

    def before_push(self) -> None:
        lent = self.loan.give_back()
        if lent is not None and self._run is not None:  # its own lane in the run's summary
            self._run.rollouts.spans.add("cores lent", LOAN_LANE, *lent)

    def weight_load_cores(self) -> list[int] | None:
        """The trainer's cores (asked for pushes the trainer waits for), when the two sides lend
        each other their idle cores."""
        return sorted(os.sched_getaffinity(0)) if self._lendable else None

    def worker_tuning(self) -> WorkerTuning:
        return CPUWorkerTuning()

    # ---- helpers --------------------------------------------------------------------------------
    def _idle_cores(self) -> list[int]:
        own = os.sched_getaffinity(0)
        return [c for c in self._lendable if c not in own]

    def _lendable_cores(self, run: TunedRun) -> list[int]:
        """The workers' cores the trainer may borrow while they are idle: only with workers
        pinned to cores of this machine and one training process."""
        options, worker_cores = run.rollouts.options, run.rollouts.worker_cores
        if not (self.lend_idle_cores and worker_cores and options.use_ray):
            return []
        if options.ray_address is not None or run.world_size != 1:
            return []
        return sorted({c for cores in worker_cores for c in cores})

    @staticmethod
    def _check_auto_device(run: TunedRun) -> None:
        """``worker_cores: auto`` moves cores of one training process on this machine."""
        if run.root_device.type != "cpu":
            raise ValueError(
                "worker_cores='auto' splits CPU cores; training on GPUs, give the workers GPUs "
                "(gpus_per_worker)"
            )
        if run.world_size > 1:
            raise ValueError("worker_cores='auto' needs one training process (no DDP/FSDP)")

    def _open_split_cache(self, run: TunedRun) -> SplitCache:
        """This run's place in the hardware split cache (its machine, workers, model and
        workload): where ``worker_cores: auto`` starts from, and what a fixed split advises
        from."""
        module, options = run.lightning_module, run.rollouts.options
        workload = workload_of(module, module.trainer, options, self.lend_idle_cores)
        return SplitCache.open(
            self._machine_cores, options.num_workers, module.model_path, workload
        )

    def _split_advisor(self, run: TunedRun) -> SplitAdvisor | None:
        """Rank 0's advisor (the workers' spans are recorded there); ``None`` without Ray."""
        options = run.rollouts.options
        if run.global_rank != 0 or not options.use_ray:
            return None
        if self.split_start is not None:
            hit = self.split_cache.hit if self.split_cache is not None else None
            model = replace(
                hit.model if hit else SplitModel(), lend_idle_cores=self.lend_idle_cores
            )
            return SplitAdvisor(
                self.split_start, self._machine_cores, options.num_workers, self.split_after,
                auto=hit is None, model=model, cached=hit is not None,
            )  # fmt: skip
        known = self._open_split_cache(run).hit  # what an auto run of this workload measured
        return log_only_advisor(
            run.rollouts.overlap, run.rollouts.worker_cores, self.lend_idle_cores,
            options.num_workers, self.trainer_cores, self._machine_cores, self.split_after,
            model=known.model if known else None,
        )  # fmt: skip


class CPUWorkerTuning(WorkerTuning):
    """Inside a rollout worker: a weight load runs on the worker's cores plus the waiting
    trainer's, handed back before the worker generates again."""

    @contextmanager
    def weight_load(self, borrowed: Iterable[int] | None) -> Iterator[object]:
        loan = CoreLoan()
        if borrowed:
            loan.lend(borrowed)
        try:
            yield loan
        finally:
            loan.give_back()
