"""`RolloutsMixin`: what turns any Lightning training strategy into a periodic-async one.

A periodic-async strategy is *a Lightning training strategy + the rollout side*: the training
side (one device, DDP, FSDP, DeepSpeed) is Lightning's own class, unchanged; the rollout side
is one :class:`~periodic_rl.rollout.controller.RolloutController`, started in ``setup`` (never
at import, so the processes DDP re-launches stay clean), and the hardware tuner the run has
(:mod:`periodic_rl.rollout.tuning`), called at its moments. ``RLModule`` reaches the rollout
side only through the methods of :class:`~periodic_rl.strategies.protocol.RolloutStrategy`:
it publishes each iteration's weights itself, right after its optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch

from periodic_rl.algorithms.mismatch import mismatch_metrics
from periodic_rl.checkpoint import AsyncAtomicCheckpointIO, AtomicCheckpointIO
from periodic_rl.rollout.budget import AsynchronyBudget, AsynchronySpec, parse_budget
from periodic_rl.rollout.chooser import ScheduleChooser, ScheduleDecision
from periodic_rl.rollout.controller import PromptShare, RolloutController
from periodic_rl.rollout.device_defaults import (
    DTYPES,
    PlacementStrategy,
    PushTransport,
    RolloutSettings,
    check_engine_dtype,
    default_engine_dtype,
    resolve_rollout,
)
from periodic_rl.rollout.engines.engine_checks import check_rollout_options
from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.pipeline import RolloutRequest
from periodic_rl.rollout.ranks import rank_link
from periodic_rl.rollout.spec import BuiltinEngine
from periodic_rl.rollout.timing import SpanRecorder
from periodic_rl.rollout.tuning import HardwareTuning, default_tuning
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.optim import Optimizer

log = logging.getLogger(__name__)

ROLLOUT_ARGS_DOC = """
        engine: ``vllm``, ``hf``, or ``package.module:Class`` of your own ``InferenceEngine``.
        engine_kwargs: passed to the engine (e.g. ``max_model_len``, ``kv_cache_gb``).
        engine_dtype: the rollout engine's dtype: ``float32``, ``bfloat16``, or ``auto``: the
            hardware tuner chooses (on the CPU, vLLM's decode speed in both is measured on the
            first worker's cores, cached in ``~/.cache/periodic_rl/engine_dtype.json``, and
            bfloat16 kept only if >= 10% faster; float32 for ``hf``), else bfloat16 on GPUs
            (docs/guide.md). Unset: ``engine_kwargs.dtype``, else the device's default
            (float32 CPU, bfloat16 GPU).
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
        asynchrony: how off-policy the run may be, instead of a fixed ``max_staleness``; the
            run then picks the fastest staleness within it from what it measures (one log line
            per decision, docs/staleness.md): ``on_policy``, ``{max_staleness: k}`` (at most
            ``k`` versions behind), or ``{max_mismatch_kl: x}`` (any staleness up to 4 while
            the measured engine/trainer ``mismatch/kl`` stays <= ``x``).
        asynchrony_window: iterations measured per decision of ``asynchrony`` (after one of
            warm-up).
        partial_rollout_tokens: with staleness, generate in chunks of this many tokens; chunk
            ``c`` of an iteration that starts at version ``v`` is sampled by version
            ``min(v + c, the iteration's own)``, the completion continuing from its own tokens
            under the newer weights, each token tagged and corrected with the version that drew
            it (partial rollouts, docs/staleness.md). ``None`` (default): in one piece.
        call_timeout_s: seconds a rollout worker may take per prompt group of a call (and for
            a weight load) before it counts as hung: it is killed and restarted, its groups
            generated again with the same seeds (docs/troubleshooting.md). ``None``: no limit.
        tuning: the hardware tuner (:class:`~periodic_rl.rollout.tuning.HardwareTuning`): by
            default :class:`~periodic_rl.cpu_tuning.CPUTuning` on the CPU (give it yourself to
            pin the workers and the trainer to cores, ``worker_cores: auto``, lend idle cores)
            and none on GPUs.
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
        engine: BuiltinEngine | str = "vllm",
        engine_kwargs: dict[str, Any] | None = None,
        engine_dtype: Literal["float32", "bfloat16", "auto"] | None = None,
        num_workers: int = 1,
        overlap: bool = True,
        use_ray: bool = True,
        ray_address: str | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float | None = None,
        groups_per_call: int | None = None,
        adapter_pushes: bool = True,
        max_staleness: int = 0,
        asynchrony: AsynchronySpec | AsynchronyBudget | None = None,
        asynchrony_window: int = 3,
        partial_rollout_tokens: int | None = None,
        call_timeout_s: float | None = 600.0,
        worker_resources: dict[str, float] | None = None,
        placement_strategy: PlacementStrategy = "PACK",
        push_transport: PushTransport = "auto",
        async_checkpoints: bool = True,
        tuning: HardwareTuning | None = None,
        **kwargs: Any,
    ) -> None:
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
            groups_per_call=groups_per_call,
            adapter_pushes=adapter_pushes,
            max_staleness=max_staleness,
            asynchrony=parse_budget(asynchrony) if asynchrony is not None else None,
            partial_rollout_tokens=partial_rollout_tokens,
            call_timeout_s=call_timeout_s,
            worker_resources=dict(worker_resources) if worker_resources else None,
            placement_strategy=placement_strategy,
            push_transport=push_transport,
        )
        check_rollout_options(options)  # installed, engine_kwargs
        if self.atomic_checkpoints:
            io = AsyncAtomicCheckpointIO() if async_checkpoints else AtomicCheckpointIO()
            kwargs.setdefault("checkpoint_io", io)
        super().__init__(**kwargs)
        self.rollouts = RolloutController(options, SpanRecorder())
        self.schedule_chooser = (
            ScheduleChooser(options.asynchrony, window=asynchrony_window)
            if options.asynchrony is not None
            else None
        )
        self.engine_dtype_pending = engine_dtype == "auto"  # resolved in setup
        self.tuning = tuning  # None: the training device's default, chosen in setup
        if tuning is not None:
            tuning.configure(self)  # refuses what it cannot apply, before Lightning starts

    # ---- lifecycle (Lightning calls these) -----------------------------------------------------
    def choose_tuning(self) -> HardwareTuning:
        """The run's hardware tuner: the one given, else the training device's default
        (:func:`~periodic_rl.rollout.tuning.default_tuning`), configured for this strategy."""
        if self.tuning is None:
            self.tuning = default_tuning(self.root_device)  # type: ignore[attr-defined]
            self.tuning.configure(self)
        return self.tuning

    def setup(self, trainer: Trainer) -> None:
        if getattr(self.lightning_module, "nothing_to_train", False):  # resumed at max_steps
            super().setup(trainer)  # type: ignore[misc]
            return
        self.choose_tuning()
        pending = self.engine_dtype_pending
        if pending and self.global_rank == 0:  # type: ignore[attr-defined]
            settings = self.rollout_settings
            on_gpu = settings.on_gpu or settings.gpus_per_worker > 0
            dtype = self.tuning.engine_dtype(self) if not on_gpu else None
            self.rollouts.set_engine_dtype(
                dtype or default_engine_dtype(self.rollouts.options.engine, on_gpu)
            )
        self.tuning.before_setup(self)
        super().setup(trainer)  # type: ignore[misc]
        module = self.lightning_module
        self.rollouts.start(
            module.model_path, rank_link, self.rollout_settings, self.tuning, module.agent_config
        )
        if pending:  # rank 0's choice on every rank (a collective: all ranks are pending)
            dtype = self.rollouts.options.engine_kwargs.get("dtype")
            self.rollouts.set_engine_dtype(self.rollouts.link.broadcast(dtype))
            self.engine_dtype_pending = False
        self.rollouts.push(self.lightning_module, self.gathered_weights)
        self.tuning.after_setup(self)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Between iterations: the hardware tuner's moment (:mod:`periodic_rl.rollout.tuning`)."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self.tuning is not None:
            self.tuning.between_iterations(self)
        if self.schedule_chooser is not None:
            self.choose_schedule(self.schedule_chooser)

    def choose_schedule(self, chooser: ScheduleChooser) -> ScheduleDecision | None:
        """Between iterations: rank 0's chooser measures and decides the staleness, every rank
        applies it (:mod:`periodic_rl.rollout.chooser`). The ``mismatch/kl`` it reads is the
        mean of every rank's (each measures its own groups)."""
        decision = None
        stats = getattr(self.lightning_module, "last_iteration", None)
        mine = mismatch_metrics(stats.loss).get("mismatch/kl") if stats is not None else None
        reported = [kl for kl in self.rollouts.link.gather(mine) if kl is not None]
        if self.global_rank == 0:  # type: ignore[attr-defined]
            kl = sum(reported) / len(reported) if reported else None
            staleness = self.rollouts.schedule.max_staleness
            decision = chooser.step(staleness, self.rollouts.spans, kl)
        switch = decision.staleness if decision is not None and decision.switch else None
        switch = self.rollouts.link.broadcast(switch)
        if switch is not None:
            self.rollouts.set_staleness(switch)
        if decision is not None:
            log.info("%s", decision.line())
            trainer = self.lightning_module.trainer
            for logger in trainer.loggers:
                logger.log_metrics(decision.metrics(), step=trainer.global_step)
        return decision

    def teardown(self) -> None:
        self.rollouts.shutdown()
        if self.tuning is not None:
            self.tuning.teardown()
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

    def policy_loading(self) -> AbstractContextManager[Any]:
        """The context the module loads its policy and reference in; a strategy that shards
        parameters as they are created overrides it (DeepSpeed ZeRO-3)."""
        return nullcontext()

    def divide_gradients(
        self, optimizer: Optimizer | LightningOptimizer, denominator: float
    ) -> None:
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
        """The most versions a trained group may lag: the fixed ``max_staleness``, or the
        ``asynchrony`` budget's bound."""
        return self.rollouts.options.staleness_bound

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

    def rollout_engine_dtype(self) -> str | None:
        """The engines' dtype as resolved for the training device (``engine_dtype``,
        ``engine_kwargs.dtype``, else the device's default)."""
        return self.rollout_settings.engine_kwargs.get("dtype")

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
