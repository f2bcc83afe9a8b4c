"""`RolloutsMixin`: what turns any Lightning training strategy into a periodic-async one.

A periodic-async strategy is *a Lightning training strategy + the rollout side*: the training
side (one device, DDP, FSDP, DeepSpeed) is Lightning's own class, unchanged; the rollout side
is one :class:`~periodic_rl.rollout.controller.RolloutController`, started in ``setup`` (never
at import, so the processes DDP re-launches stay clean) and told after every optimizer step to
push the new weights (``optimizer_step`` is the one place every ``LightningOptimizer.step``
goes through). ``RLModule`` reaches the rollout side only through the methods of
:class:`~periodic_rl.strategies.protocol.RolloutStrategy`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Literal

import torch

from periodic_rl.checkpoint import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from periodic_rl.heap import keep_freed_memory
from periodic_rl.rollout.controller import PromptShare, RolloutController
from periodic_rl.rollout.device_defaults import RolloutSettings, resolve_rollout
from periodic_rl.rollout.engine_checks import check_rollout_options
from periodic_rl.rollout.engine_dtype import (
    DTYPES,
    DtypeChoice,
    check_engine_dtype,
    resolve_engine_dtype,
)
from periodic_rl.rollout.hardware_split import Candidate, SplitModel
from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.pipeline import RolloutRequest
from periodic_rl.rollout.processes import repin_threads
from periodic_rl.rollout.ranks import rank_link
from periodic_rl.rollout.split_advisor import (
    SplitAdvisor,
    auto_start,
    iterations_left,
    log_only_advisor,
)
from periodic_rl.rollout.split_cache import SplitCache, workload_of
from periodic_rl.rollout.timing import SpanRecorder
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

log = logging.getLogger(__name__)

ROLLOUT_ARGS_DOC = """
        engine: ``vllm``, ``hf``, or ``package.module:Class`` of your own ``InferenceEngine``.
        engine_kwargs: passed to the engine (e.g. ``max_model_len``, ``kv_cache_gb``).
        engine_dtype: the rollout engine's dtype: ``float32``, ``bfloat16``, or ``auto``: on the
            CPU, vLLM's decode speed in both is measured on the first worker's cores (cached in
            ``~/.cache/periodic_rl/engine_dtype.json``) and bfloat16 kept only if >= 10% faster;
            bfloat16 for vLLM on GPUs, float32 for ``hf`` (docs/guide.md). Unset:
            ``engine_kwargs.dtype``, else the device's default (float32 CPU, bfloat16 GPU).
        num_workers: rollout workers (Ray actors), each holding one engine, shared by all
            training ranks.
        overlap: back-propagate groups while the rest of the iteration is still being generated
            (periodic asynchrony). ``False`` is the synchronous baseline on the same machinery.
        use_ray: run the engines in Ray actors. ``False`` keeps one engine in rank 0's process
            (no overlap possible; handy for debugging).
        ray_address: an existing Ray cluster; by default a local one without a dashboard (see
            docs/troubleshooting.md for the ports Ray opens).
        cpus_per_worker, gpus_per_worker: Ray resources reserved per worker
            (``gpus_per_worker`` unset: 0 on the CPU, the engine's ``tensor_parallel_size``
            when the Trainer trains on GPUs; :mod:`periodic_rl.rollout.device_defaults`).
        worker_resources: further Ray resources each worker needs, e.g. ``{"rollout": 1}`` to
            place the workers on the nodes started with ``--resources='{"rollout": N}'``.
        placement_strategy: how the workers' placement group spreads them over the nodes
            (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``; docs/scaling.md).
        push_transport: ``object_store`` (weights through host memory and Ray's object
            store), ``broadcast`` (a collective from rank 0 into the workers: NCCL between
            GPUs, no host round trip), or ``auto`` (default: ``broadcast`` on GPUs).
        worker_cores: CPU cores to pin each worker to (one list per worker), or ``auto``:
            start taking turns on all cores (``overlap`` is then chosen too), measure, and
            move to overlap on disjoint cores only where the measured rates predict it faster;
            after a window there, keep the faster split (CPU, one training process, local
            Ray, ``max_staleness: 0``; docs/scaling.md). The choice is remembered per machine
            and workload (``~/.cache/periodic_rl/hardware_split.json``, or
            ``$PERIODIC_RL_SPLIT_CACHE``): the next such run starts on it, exploring nothing.
        trainer_cores: CPU cores to pin each training process to (with ``worker_cores``, the
            two sides do not fight over cores; chosen by ``worker_cores: auto``).
        lend_idle_cores: with ``worker_cores`` and ``trainer_cores`` (or ``auto``) on one
            machine: once an iteration is generated, the trainer also uses the workers' cores
            from that moment (inside the micro-batch it is training) through the optimizer
            step, and gives them back before the
            weight push (:mod:`periodic_rl.rollout.core_loan`; 1.06-1.09x per step where measured,
            docs/overlap.md); while the trainer waits for a weight push, the workers load it
            on the trainer's cores as well. ``False``: each side keeps to its own cores
            throughout.
        split_after: iterations measured (after one of warm-up) before the run logs its
            generation and training rates and the split that would balance them
            (``split/*`` metrics); with ``worker_cores: auto``, per measured split.
        groups_per_call: prompt groups handed to a worker per call (batching vs streaming).
            Overlapped, each worker's first call and the iteration's last calls carry one
            micro-batch's groups, so training starts and ends sooner (docs/overlap.md).
            ``None`` (default): 2 overlapped; with overlap off, each worker's share of the
            iteration in one call (one engine batch generates it fastest, and the trainer
            waits for all of it anyway).
        adapter_pushes: with LoRA, push the base weights once and then only the adapter
            factors, which the workers merge themselves; ``False`` pushes the full merged
            weights every iteration.
        max_staleness: ``0`` (default): exactly on-policy, each iteration generated by the
            weights it is trained from. ``k >= 1``: bounded staleness; the workers generate
            iteration ``j`` with the weights of version ``j - k`` while the trainer trains the
            iterations before it, and the loss corrects with truncated importance weights
            against the behaviour log-probs (docs/staleness.md).
        call_timeout_s: seconds a rollout worker may take per prompt group of a call (and for
            a weight load) before it counts as hung: it is killed and restarted, its groups
            generated again with the same seeds (docs/troubleshooting.md). ``None``: no limit.
        async_checkpoints: write one-file checkpoints in a background thread from a copy taken
            at the save (:class:`~periodic_rl.checkpoint.AsyncAtomicCheckpointIO`), so that
            saving does not stall training; ``False`` writes them before training goes on.
"""


class RolloutsMixin:
    """The rollout side of a periodic-async strategy; mixed in before a Lightning strategy,
    whose own arguments pass through ``kwargs``. The rollout arguments: ``ROLLOUT_ARGS_DOC``."""

    atomic_checkpoints = True  # one-file checkpoints written through a rename (AtomicCheckpointIO)

    def __init__(
        self,
        engine: str = "vllm",
        engine_kwargs: dict[str, Any] | None = None,
        engine_dtype: Literal["float32", "bfloat16", "auto"] | None = None,
        num_workers: int = 1,
        overlap: bool = True,
        use_ray: bool = True,
        ray_address: str | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float | None = None,
        worker_cores: list[list[int]] | Literal["auto"] | None = None,
        trainer_cores: list[int] | None = None,
        groups_per_call: int | None = None,
        adapter_pushes: bool = True,
        max_staleness: int = 0,
        call_timeout_s: float | None = 600.0,
        worker_resources: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        push_transport: str = "auto",
        async_checkpoints: bool = True,
        split_after: int = 3,
        lend_idle_cores: bool = True,
        **kwargs: Any,
    ) -> None:
        start: Candidate | None = None
        if worker_cores == "auto":  # refuses what it cannot apply; picks the starting split
            start = auto_start(
                num_workers, use_ray, ray_address, gpus_per_worker, max_staleness, trainer_cores
            )
            worker_cores = [list(cores) for cores in start.worker_cores]
            trainer_cores, overlap = list(start.trainer_cores), start.overlap
        elif isinstance(worker_cores, str):
            raise ValueError(
                f"worker_cores must be lists of cores, 'auto' or null: {worker_cores!r}"
            )
        if split_after < 1:
            raise ValueError(f"split_after must be >= 1 iteration, got {split_after}")
        check_engine_dtype(engine_dtype, engine, engine_kwargs or {})
        if engine_dtype in DTYPES:  # a concrete dtype is the engine's own dtype argument
            engine_kwargs = {**(engine_kwargs or {}), "dtype": engine_dtype}
        options = RolloutOptions(  # checks the arguments before Lightning sees any
            engine=engine,
            engine_kwargs=dict(engine_kwargs or {}),
            num_workers=num_workers,
            overlap=overlap,
            use_ray=use_ray,
            ray_address=ray_address,
            cpus_per_worker=cpus_per_worker,
            gpus_per_worker=gpus_per_worker,
            worker_cores=worker_cores,
            groups_per_call=groups_per_call,
            adapter_pushes=adapter_pushes,
            max_staleness=max_staleness,
            call_timeout_s=call_timeout_s,
            worker_resources=dict(worker_resources) if worker_resources else None,
            placement_strategy=placement_strategy,
            push_transport=push_transport,
            lend_idle_cores=lend_idle_cores,
        )
        check_rollout_options(options, trainer_cores)  # installed, engine_kwargs, cores
        if self.atomic_checkpoints:
            io = AsyncAtomicCheckpointIO() if async_checkpoints else AtomicCheckpointIO()
            kwargs.setdefault("checkpoint_io", io)
        super().__init__(**kwargs)
        self.rollouts = RolloutController(options, SpanRecorder())
        self.trainer_cores = trainer_cores
        self.split_start, self.split_after = start, split_after
        self.split_advisor: SplitAdvisor | None = None  # rank 0, from setup
        self._machine_cores = sorted(os.sched_getaffinity(0))  # before any pinning
        self.engine_dtype_pending = engine_dtype == "auto"  # resolved in setup
        self.engine_dtype_choice: DtypeChoice | None = None  # rank 0's, once resolved

    # ---- lifecycle (Lightning calls these) -----------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if self.split_start is not None:
            self._check_auto_device()
        pending = self.engine_dtype_pending
        if pending and self.global_rank == 0:  # type: ignore[attr-defined]
            self._resolve_engine_dtype(trainer)  # before the trainer pins its cores
        self.split_cache: SplitCache | None = None
        if self.split_start is not None:  # start on the split a run of this workload chose
            self.split_cache = self._open_split_cache()
            hit = self.split_cache.hit
            if hit is not None:
                self.split_start, self.trainer_cores = hit.split, list(hit.split.trainer_cores)
                self.rollouts.overlap = hit.split.overlap
                self.rollouts.worker_cores = [list(cores) for cores in hit.split.worker_cores]
                log.info("hardware split: cached from %s: %s", hit.date, hit.describe())
        if self.trainer_cores:
            os.sched_setaffinity(0, set(self.trainer_cores))
            torch.set_num_threads(len(self.trainer_cores))
        if self.root_device.type == "cpu":  # type: ignore[attr-defined]
            keep_freed_memory()  # each step's large buffers reused, not page-faulted in again
        super().setup(trainer)  # type: ignore[misc]
        self.rollouts.start(self.lightning_module.model_path, rank_link, self.rollout_settings)
        if pending:  # rank 0's choice on every rank (a collective: all ranks are pending)
            dtype = self.engine_dtype_choice.dtype if self.engine_dtype_choice else None
            self.rollouts.set_engine_dtype(self.rollouts.link.broadcast(dtype))
            self.engine_dtype_pending = False
        self.rollouts.push(self.lightning_module, self.gathered_weights)
        self.split_advisor = self._split_advisor()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Between iterations: once a window of iterations is measured, log the rates and the
        split that would balance them (and, with ``worker_cores: auto``, apply it)."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        advisor = self.split_advisor
        step = (
            advisor.step(self.spans, iterations_left(self.lightning_module.trainer))
            if advisor
            else None
        )
        if step is None:
            return
        # To the loggers once per window (self.log from this hook was re-logged at every step).
        trainer = self.lightning_module.trainer
        metrics = step.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
        log.info("hardware split: %s%s", step.reason, "; applying it" if step.apply else "")
        if step.apply is not None:
            before = set(os.sched_getaffinity(0))
            repin_threads(list(step.apply.trainer_cores), before)
            self.trainer_cores = list(step.apply.trainer_cores)
            self.rollouts.overlap = step.apply.overlap  # read at each iteration's start
            self.rollouts.set_worker_cores([list(cores) for cores in step.apply.worker_cores])
        if step.final and not step.deferred and self.split_cache is not None:  # auto
            if self.split_cache.hit is None:
                self.split_cache.remember(step, self.split_advisor.windows)
            else:
                self.split_cache.check(step)

    def _resolve_engine_dtype(self, trainer: Any) -> None:
        """``engine_dtype: auto`` (:mod:`periodic_rl.rollout.engine_dtype`), measured on the
        cores the first worker will run on: its ``worker_cores``, else as many of this
        process's cores as the threads Ray gives it (``cpus_per_worker``); without Ray, the
        trainer's (the engine runs in its process)."""
        options, settings = self.rollouts.options, self.rollout_settings
        cores = (self.rollouts.worker_cores or [[]])[0]
        if not options.use_ray:
            cores = self.trainer_cores or self._machine_cores
        if not cores:
            cores = self._machine_cores[: max(1, int(options.cpus_per_worker))]
        on_gpu = settings.on_gpu or settings.gpus_per_worker > 0
        choice = resolve_engine_dtype(
            options.engine, self.lightning_module.model_path, list(cores), on_gpu
        )
        self.rollouts.set_engine_dtype(choice.dtype)
        self.engine_dtype_choice = choice
        for logger in trainer.loggers:
            logger.log_metrics(choice.metrics(), step=trainer.global_step)

    def _check_auto_device(self) -> None:
        """``worker_cores: auto`` moves cores of one training process on this machine."""
        if self.root_device.type != "cpu":  # type: ignore[attr-defined]
            raise ValueError(
                "worker_cores='auto' splits CPU cores; training on GPUs, give the workers GPUs "
                "(gpus_per_worker) and read the logged split/* advice instead"
            )
        if (getattr(self, "num_processes", 1) or 1) > 1:
            raise ValueError("worker_cores='auto' needs one training process (no DDP/FSDP)")

    def _open_split_cache(self) -> SplitCache:
        """This run's place in the hardware split cache (its machine, workers, model and
        workload): where ``worker_cores: auto`` starts from, and what a fixed split advises
        from."""
        module, options = self.lightning_module, self.rollouts.options
        workload = workload_of(module, module.trainer, options)
        return SplitCache.open(
            self._machine_cores, options.num_workers, module.model_path, workload
        )

    def _split_advisor(self) -> SplitAdvisor | None:
        """Rank 0's advisor (the workers' spans are recorded there); ``None`` without Ray."""
        options = self.rollouts.options
        if self.rollouts.link.rank != 0 or not options.use_ray:
            return None
        if self.split_start is not None:
            hit = self.split_cache.hit if self.split_cache is not None else None
            model = replace(
                hit.model if hit else SplitModel(), lend_idle_cores=options.lend_idle_cores
            )
            return SplitAdvisor(
                self.split_start, self._machine_cores, options.num_workers, self.split_after,
                auto=hit is None, model=model, cached=hit is not None,
            )  # fmt: skip
        devices = getattr(self, "parallel_devices", None) or [self.root_device]  # type: ignore[attr-defined]
        known = None  # what a worker_cores: auto run of this workload measured, if one did
        if not self.rollout_settings.on_gpu:
            known = self._open_split_cache().hit
        return log_only_advisor(
            options, self.trainer_cores, self._machine_cores, self.rollout_settings,
            len(devices), self.split_after, model=known.model if known else None,
        )  # fmt: skip

    def teardown(self) -> None:
        self.rollouts.shutdown()
        super().teardown()  # type: ignore[misc]

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        self.rollouts.weights_will_change()
        with self.spans.span("optimizer step", "trainer"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    # ---- what the training side decides ------------------------------------------------------
    @property
    def rollout_settings(self) -> RolloutSettings:
        """The rollout options with the defaults of the training device filled in
        (:mod:`periodic_rl.rollout.device_defaults`): GPU settings when the Trainer trains on
        GPUs. The local Ray gets the GPUs of this machine that no training rank uses."""
        device = self.root_device  # type: ignore[attr-defined]
        trainer_gpus: list[int] = []
        total = 0
        if device.type == "cuda":
            total = torch.cuda.device_count()
            devices = getattr(self, "parallel_devices", None) or [device]
            trainer_gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        return resolve_rollout(self.rollouts.options, device.type, trainer_gpus, total)

    def gathered_weights(self) -> AbstractContextManager[Any]:
        """A context in which rank 0's module holds whole weights for a push; sharded
        strategies override it (:mod:`periodic_rl.weight_sync.gather`)."""
        return nullcontext()

    def divide_gradients(self, optimizer: Any, denominator: float) -> None:
        """Divide the accumulated gradients of ``optimizer``'s parameters by ``denominator``
        (the iteration's loss normaliser, known only once every micro-batch is in)."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(denominator)

    # ---- RolloutStrategy: what RLModule uses ---------------------------------------------------
    @property
    def spans(self) -> SpanRecorder:
        return self.rollouts.spans

    @property
    def policy_version(self) -> int:
        return self.rollouts.version

    @property
    def weights_fingerprint(self) -> str:
        return self.rollouts.fingerprint

    @property
    def max_staleness(self) -> int:
        return self.rollouts.options.max_staleness

    def weights_fingerprint_of(self, version: int) -> str | None:
        return self.rollouts.fingerprint_of(version)

    def iterations_ahead(self, iteration: int, end: float) -> list[int]:
        return self.rollouts.iterations_ahead(iteration, end)

    def ahead_state(self) -> dict[str, Any]:
        """For the checkpoint: what resuming bounded staleness exactly needs."""
        return self.rollouts.ahead_state()

    def resume_ahead(self, state: dict[str, Any]) -> None:
        self.rollouts.resume_ahead(state, self.lightning_module)

    def publish(self, version: int) -> None:
        """The policy stepped to ``version``: the weights of the next iteration (pushed now,
        or when the schedule needs them: :meth:`~periodic_rl.rollout.controller.
        RolloutController.publish`)."""
        self.rollouts.publish(version, self.lightning_module, self.gathered_weights)

    @property
    def rollout_engine(self) -> str:
        return self.rollouts.options.engine

    @property
    def push_counts(self) -> dict[str, int]:
        return dict(self.rollouts.pusher.counts)

    def sync_version(self, version: int, steps_per_iteration: int = 1) -> None:
        """At the start of a fit: the version (and optimizer steps per iteration) the run
        continues from; a resumed run re-pushes its weights."""
        self.rollouts.restore_version(
            version, self.lightning_module, self.gathered_weights, steps_per_iteration
        )

    def share_prompts(self, rows: list[Any]) -> PromptShare:
        return self.rollouts.share_prompts(rows)

    def generate_groups(
        self, jobs: list[GroupJob], sampling: SamplingConfig
    ) -> list[GeneratedGroup]:
        """All groups of ``jobs`` with the current weights, on every rank (evaluation)."""
        return self.rollouts.generate(jobs, sampling, self.lightning_module, self.gathered_weights)

    def rollout_micro_batches(
        self,
        request: RolloutRequest,
        micro_batch_size: int,
        ahead: Sequence[RolloutRequest] = (),
    ) -> Iterator[list[RolloutGroup]]:
        """This rank's scored groups, in micro-batches (see
        :meth:`~periodic_rl.rollout.controller.RolloutController.micro_batches`)."""
        return self.rollouts.micro_batches(request, micro_batch_size, ahead)
