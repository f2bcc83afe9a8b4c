"""`PeriodicAsyncStrategy`: a Lightning strategy that owns the rollout workers.

It starts the workers in ``setup`` (never at import, so DDP's re-launched scripts stay clean),
streams each iteration's scored groups to the module, and, in ``optimizer_step`` (the one place
every ``LightningOptimizer.step`` goes through), bumps the policy version and pushes the new
weights to every worker before the next iteration's generation starts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

from periodic_rl.checkpoint import AtomicCheckpointIO
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.stream import GroupStream
from periodic_rl.rollout.timing import SpanRecorder
from periodic_rl.rollout.types import GeneratedGroup, GroupJob, RolloutGroup, SamplingConfig
from periodic_rl.weight_sync.export import adapted_names

ScoreFn = Callable[[GeneratedGroup], RolloutGroup]


class PeriodicAsyncStrategy(SingleDeviceStrategy):
    """Train on one device while rollout workers generate, staying exactly on-policy.

    Args:
        engine: ``vllm``, ``hf``, or ``package.module:Class`` of your own ``InferenceEngine``.
        engine_kwargs: passed to the engine (e.g. ``max_model_len``, ``kv_cache_gb``).
        num_workers: rollout workers (Ray actors), each holding one engine.
        overlap: back-propagate groups while the rest of the iteration is still being generated
            (periodic asynchrony). ``False`` is the synchronous baseline on the same machinery.
        use_ray: run the engines in Ray actors. ``False`` keeps one engine in this process
            (no overlap possible; handy for debugging).
        ray_address: an existing Ray cluster; by default a local one without a dashboard (see
            docs/troubleshooting.md for the ports Ray opens).
        cpus_per_worker, gpus_per_worker: Ray resources reserved per worker.
        worker_cores: CPU cores to pin each worker to (one list per worker).
        trainer_cores: CPU cores to pin the trainer to (with ``worker_cores``, the two sides do
            not fight over cores).
        groups_per_call: prompt groups handed to a worker per call (batching vs streaming).
            Overlapped, each worker's first call and the iteration's last calls carry one
            micro-batch's groups, so training starts and ends sooner (docs/overlap.md).
        device: the training device, e.g. ``cuda:1``. Default: the Trainer's, from its
            ``accelerator`` and ``devices`` (``Trainer(accelerator="gpu", devices=1)`` trains
            on ``cuda:0``). One device: ``devices`` above 1 is refused (multi-device training
            strategies are planned); the rollout workers take their own GPUs through Ray
            (``gpus_per_worker``).
        adapter_pushes: with LoRA, push the base weights once and then only the adapter
            factors, which the workers merge themselves (:mod:`periodic_rl.weight_sync.merge`);
            ``False`` pushes the full merged weights every iteration.
    """

    strategy_name = "periodic_async"

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
        device: str | None = None,
        adapter_pushes: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(device=torch.device(device or "cpu"), **kwargs)
        self._device = torch.device(device) if device is not None else None
        self._parallel_devices: list[torch.device] | None = None
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not use_ray and (overlap or num_workers != 1):
            raise ValueError(
                "use_ray=False runs one engine inside the trainer's process: it needs "
                "num_workers=1 and overlap=False (overlap needs workers in their own processes)"
            )
        if worker_cores is not None and len(worker_cores) != num_workers:
            raise ValueError(
                f"worker_cores has {len(worker_cores)} entries for num_workers={num_workers}"
            )
        self.engine_name = engine
        self.engine_kwargs = dict(engine_kwargs or {})
        self.num_workers = num_workers
        self.overlap = overlap
        self.use_ray = use_ray
        self.ray_address = ray_address
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.worker_cores = worker_cores
        self.trainer_cores = trainer_cores
        self.groups_per_call = groups_per_call
        self.adapter_pushes = adapter_pushes
        self.rollouts: Any = None
        self.policy_version = 0
        self.weights_fingerprint = ""
        self.spans = SpanRecorder()
        self.push_counts = {"full": 0, "base+adapter": 0, "adapter": 0}
        self._base_on: tuple[Any, list[str]] | None = None  # (rollouts, kept names) of the base

    # ---- device -----------------------------------------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices the Trainer's accelerator connector picked (it sets them when the Trainer
        is built, from ``accelerator`` and ``devices``); this strategy trains on the first."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"PeriodicAsyncStrategy trains on one device, but the Trainer asks for "
                f"{len(devices)} ({', '.join(str(d) for d in devices)}): multi-device training "
                "is not supported yet (multi-device strategies are planned). Set "
                "Trainer(devices=1) (YAML: trainer.devices: 1), or pick the device with "
                "PeriodicAsyncStrategy(device=...); the rollout workers take their own GPUs "
                "through gpus_per_worker."
            )
        self._parallel_devices = list(devices) if devices else None

    @property
    def root_device(self) -> torch.device:
        """``device`` when given, else the device the Trainer's accelerator picked."""
        if self._device is not None:
            return self._device
        if self._parallel_devices:
            return self._parallel_devices[0]
        return torch.device("cpu")

    # ---- lifecycle --------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if self.trainer_cores:
            os.sched_setaffinity(0, set(self.trainer_cores))
            torch.set_num_threads(len(self.trainer_cores))
        super().setup(trainer)
        if self.rollouts is None:
            self.rollouts = self._start_rollouts(self.lightning_module.model_path)
        self.push_weights()

    def _start_rollouts(self, model_path: str) -> Any:
        spec = EngineSpec(kind=self.engine_name, model=model_path, kwargs=self.engine_kwargs)
        if not self.use_ray:
            from periodic_rl.rollout.local import LocalRollouts

            return LocalRollouts(spec.build(), spans=self.spans)
        from periodic_rl.rollout.fabric import RolloutFabric

        fabric = RolloutFabric(
            spec,
            num_workers=self.num_workers,
            ray_address=self.ray_address,
            cpus_per_worker=self.cpus_per_worker,
            gpus_per_worker=self.gpus_per_worker,
            worker_cores=self.worker_cores,
            groups_per_call=self.groups_per_call,
            spans=self.spans,
            # vLLM logs two harmless warnings and three info lines per weight push (rotary and
            # tied lm_head have nothing to load); set VLLM_LOGGING_LEVEL=INFO to see them.
            env_vars={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")},
        )
        fabric.start()
        return fabric

    def teardown(self) -> None:
        if self.rollouts is not None:
            self.rollouts.shutdown()
            self.rollouts = None
        super().teardown()

    # ---- weights ------------------------------------------------------------------------------
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        with self.spans.span("optimizer step", "trainer"):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.policy_version += 1
        self.push_weights()
        return output

    def sync_version(self, version: int) -> None:
        """After a resume, continue the version count at ``version`` and re-push the weights."""
        if version != self.policy_version:
            self.policy_version = version
            self.push_weights()

    def push_weights(self) -> str:
        """Send the policy's current weights to every worker and record their fingerprint.

        With a LoRA adapter the rollouts can merge (``adapter_pushes``), the base goes once to
        each set of rollouts and every push after it carries only the adapter; the fingerprint
        is then the one of base and adapter together (``adapter_fingerprint``).
        """
        start = time.time()
        module, version = self.lightning_module, self.policy_version
        adapter = module.rollout_adapter() if self.adapter_pushes else None
        try:
            if adapter is None:
                kind, self._base_on = "full", None
                fingerprint = self.rollouts.push_weights(module.rollout_state_dict(), version)
            else:
                kind, keep = "adapter", adapted_names(adapter)
                if self._base_on is None or self._base_on != (self.rollouts, keep):
                    kind, self._base_on = "base+adapter", None
                    base = module.rollout_base_state_dict()
                    self.rollouts.push_weights(base, version, keep=keep)
                    self._base_on = (self.rollouts, keep)
                fingerprint = self.rollouts.push_adapter(adapter, version)
        except BaseException:
            self._base_on = None  # the rollouts' state is unknown: start again from the base
            raise
        self.weights_fingerprint = fingerprint
        self.push_counts[kind] += 1
        self.spans.add("weight push", "trainer", start, time.time(), kind=kind)
        return fingerprint

    # ---- rollouts -----------------------------------------------------------------------------
    def generate_groups(
        self, jobs: list[GroupJob], sampling: SamplingConfig
    ) -> list[GeneratedGroup]:
        """All groups of ``jobs`` with the current weights (evaluation; no streaming)."""
        share = -(-len(jobs) // self.num_workers)  # one large call per worker: nothing streams
        previous = self.spans.iteration
        self.spans.new_iteration(None)  # evaluation is no iteration's generation time
        try:
            return list(self.rollouts.generate(jobs, sampling, self.policy_version, share))
        finally:
            self.spans.new_iteration(previous)

    def rollout_micro_batches(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        score: ScoreFn,
        micro_batch_size: int,
        on_all_scored: Callable[[list[RolloutGroup]], None] | None = None,
    ) -> Iterator[list[RolloutGroup]]:
        """Scored groups of this iteration, in micro-batches of whole groups.

        Overlapped: a background thread scores groups as workers finish them and the trainer
        takes each micro-batch as soon as it is complete, in completion order. Synchronous (or
        when advantages need the whole iteration, ``on_all_scored``): everything is generated
        and scored first.

        Closing this iterator early (the training step raised; ``RLModule`` closes it) cancels
        the stream: the producer stops dispatching the iteration's remaining calls, the calls
        in flight are dropped, and the close returns once the producer has stopped, instead of
        after the whole iteration's generation.
        """
        self.spans.new_iteration(self.policy_version)
        stream = GroupStream()
        producer = threading.Thread(
            target=self._produce,
            args=(jobs, sampling, score, stream, on_all_scored, micro_batch_size),
            name="periodic-rl-rollouts",
            daemon=True,
        )
        producer.start()
        try:
            if not self.overlap:
                with self.spans.span("wait", "trainer"):
                    producer.join()  # the synchronous baseline: generate everything, then train
            while True:
                wait_start = time.time()
                groups = stream.get_micro_batch(micro_batch_size)
                self.spans.add("wait", "trainer", wait_start, time.time())
                if groups is None:
                    return
                train_start = time.time()
                yield groups
                self.spans.add("train micro-batch", "trainer", train_start, time.time())
        finally:
            stream.cancel()  # a no-op once drained; else the producer stops generating
            producer.join()

    def _produce(
        self,
        jobs: list[GroupJob],
        sampling: SamplingConfig,
        score: ScoreFn,
        stream: GroupStream,
        on_all_scored: Callable[[list[RolloutGroup]], None] | None,
        micro_batch_size: int,
    ) -> None:
        """Generate and score the iteration's groups into ``stream`` (runs in its own thread);
        stops early when the consumer cancels the stream."""
        group_size = max(1, jobs[0].n) if jobs else 1
        ramp = -(-micro_batch_size // group_size) if self.overlap else None
        # The Ray fabric watches the cancel event between its worker calls; the in-process
        # backend generates the iteration in one engine call, with nothing to stop in between.
        cancel = {"cancel": stream.cancel_event} if self.use_ray else {}
        try:
            held: list[RolloutGroup] = []
            calls = self.rollouts.generate(
                jobs, sampling, self.policy_version, ramp_groups=ramp, **cancel
            )
            with closing(calls):  # leaving early drops the calls still in flight
                for generated in calls:
                    if stream.cancelled:
                        return
                    group = score(generated)
                    if on_all_scored is None:
                        stream.put(group)
                    else:
                        held.append(group)
            if stream.cancelled:
                return
            if on_all_scored is not None:  # advantages that need every reward of the iteration
                on_all_scored(held)
                for group in held:
                    stream.put(group)
            stream.close()
        except BaseException as error:  # re-raised in the trainer's thread
            stream.error(error)


StrategyRegistry.register(
    PeriodicAsyncStrategy.strategy_name,
    PeriodicAsyncStrategy,
    description="Periodic-asynchrony RL: rollout workers overlapped with on-policy training",
)
