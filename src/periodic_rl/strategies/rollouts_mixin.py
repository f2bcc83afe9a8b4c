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

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from periodic_rl.checkpoint import AtomicCheckpointIO
from periodic_rl.rollout.controller import PromptShare, RolloutController, RolloutOptions
from periodic_rl.rollout.producer import AllScoredFn, ScoreFn
from periodic_rl.rollout.ranks import rank_link
from periodic_rl.rollout.timing import SpanRecorder
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig

ROLLOUT_ARGS_DOC = """
        engine: ``vllm``, ``hf``, or ``package.module:Class`` of your own ``InferenceEngine``.
        engine_kwargs: passed to the engine (e.g. ``max_model_len``, ``kv_cache_gb``).
        num_workers: rollout workers (Ray actors), each holding one engine, shared by all
            training ranks.
        overlap: back-propagate groups while the rest of the iteration is still being generated
            (periodic asynchrony). ``False`` is the synchronous baseline on the same machinery.
        use_ray: run the engines in Ray actors. ``False`` keeps one engine in rank 0's process
            (no overlap possible; handy for debugging).
        ray_address: an existing Ray cluster; by default a local one without a dashboard (see
            docs/troubleshooting.md for the ports Ray opens).
        cpus_per_worker, gpus_per_worker: Ray resources reserved per worker.
        worker_cores: CPU cores to pin each worker to (one list per worker).
        trainer_cores: CPU cores to pin each training process to (with ``worker_cores``, the
            two sides do not fight over cores).
        groups_per_call: prompt groups handed to a worker per call (batching vs streaming).
            Overlapped, each worker's first call and the iteration's last calls carry one
            micro-batch's groups, so training starts and ends sooner (docs/overlap.md).
        adapter_pushes: with LoRA, push the base weights once and then only the adapter
            factors, which the workers merge themselves; ``False`` pushes the full merged
            weights every iteration.
"""


class RolloutsMixin:
    """The rollout side of a periodic-async strategy; mixed in before a Lightning strategy,
    whose own arguments pass through ``kwargs``. The rollout arguments: ``ROLLOUT_ARGS_DOC``."""

    atomic_checkpoints = True  # one-file checkpoints written through a rename (AtomicCheckpointIO)

    def __init__(
        self,
        engine: str = "vllm",
        engine_kwargs: dict[str, Any] | None = None,
        num_workers: int = 1,
        overlap: bool = True,
        use_ray: bool = True,
        ray_address: str | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        worker_cores: list[list[int]] | None = None,
        trainer_cores: list[int] | None = None,
        groups_per_call: int = 2,
        adapter_pushes: bool = True,
        **kwargs: Any,
    ) -> None:
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
        )
        if self.atomic_checkpoints:
            kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)
        self.rollouts = RolloutController(options, SpanRecorder())
        self.trainer_cores = trainer_cores

    # ---- lifecycle (Lightning calls these) -----------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if self.trainer_cores:
            os.sched_setaffinity(0, set(self.trainer_cores))
            torch.set_num_threads(len(self.trainer_cores))
        super().setup(trainer)  # type: ignore[misc]
        self.rollouts.start(self.lightning_module.model_path, rank_link)
        self.rollouts.push(self.lightning_module, self.gathered_weights)

    def teardown(self) -> None:
        self.rollouts.shutdown()
        super().teardown()  # type: ignore[misc]

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        with self.spans.span("optimizer step", "trainer"):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        self.rollouts.stepped(self.lightning_module, self.gathered_weights)
        return output

    # ---- what the training side decides ------------------------------------------------------
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
    def rollout_engine(self) -> str:
        return self.rollouts.options.engine

    @property
    def push_counts(self) -> dict[str, int]:
        return dict(self.rollouts.pusher.counts)

    def sync_version(self, version: int) -> None:
        """After a resume, continue the version count at ``version`` and re-push the weights."""
        self.rollouts.restore_version(version, self.lightning_module, self.gathered_weights)

    def share_prompts(self, rows: list[Any]) -> PromptShare:
        return self.rollouts.share_prompts(rows)

    def generate_groups(
        self, jobs: list[GroupJob], sampling: SamplingConfig
    ) -> list[GeneratedGroup]:
        """All groups of ``jobs`` with the current weights, on every rank (evaluation)."""
        return self.rollouts.generate(jobs, sampling)

    def rollout_micro_batches(
        self,
        jobs: list[GroupJob],
        owners: list[int],
        sampling: SamplingConfig,
        score: ScoreFn,
        micro_batch_size: int,
        on_all_scored: AllScoredFn | None = None,
    ) -> Iterator[list[RolloutGroup]]:
        """This rank's scored groups, in micro-batches (see
        :meth:`~periodic_rl.rollout.controller.RolloutController.micro_batches`)."""
        return self.rollouts.micro_batches(
            jobs, owners, sampling, score, micro_batch_size, on_all_scored
        )
