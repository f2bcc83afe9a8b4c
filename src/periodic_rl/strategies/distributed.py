"""Several training devices + the rollout side: DDP, FSDP (FSDP2) and DeepSpeed ZeRO.

Each class is Lightning's own training strategy with :class:`~periodic_rl.strategies.
rollouts_mixin.RolloutsMixin` in front. In every one of them:

- one iteration is ``world_size x batch_size`` prompts; each rank draws its own slice
  (:class:`~periodic_rl.data.loader.PromptLoader`) and back-propagates its own groups as they
  stream in; rank 0 drives the rollout workers for all ranks (docs/scaling.md);
- the loss is the one-batch loss of the whole iteration (the normaliser's counts are summed
  over ranks, ``RLModule._normalise_gradients``);
- after the optimizer step rank 0 pushes the full weights (gathered from the shards where the
  strategy shards them) and every rank learns the new version and fingerprint;
- with ``MASTER_ADDR`` on loopback (one machine, Lightning's default), the ranks' rendezvous
  listens on loopback only (:func:`periodic_rl.compat.torch_distributed.loopback_rendezvous`).

Pick one by name in YAML (``strategy: periodic_async_ddp``) or pass an instance.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    StrategyRegistry,
)

from periodic_rl.compat.torch_distributed import loopback_rendezvous
from periodic_rl.strategies.rollouts_mixin import ROLLOUT_ARGS_DOC, RolloutsMixin
from periodic_rl.weight_sync.gather import (
    fsdp2_full_tensor,
    gathered_on_rank0,
    zero3_full_tensor,
)

_ARGS = """

    Args:{rollout_args}
        **kwargs: the arguments of Lightning's ``{base}``.
"""


class _LoopbackRendezvous:
    """Lightning's process-group set-up, with the store and gloo kept on loopback when the
    main address is a loopback one."""

    def setup_distributed(self) -> None:
        with loopback_rendezvous():
            super().setup_distributed()  # type: ignore[misc]


class PeriodicAsyncDDPStrategy(_LoopbackRendezvous, RolloutsMixin, DDPStrategy):
    """Data-parallel training (Lightning's DDP) + the rollout side: every rank holds the whole
    model; gradients are averaged over ranks after each micro-batch's backward."""

    strategy_name = "periodic_async_ddp"


class PeriodicAsyncFSDPStrategy(_LoopbackRendezvous, RolloutsMixin, ModelParallelStrategy):
    """Fully sharded training (FSDP2, ``fully_shard``, through Lightning's
    ``ModelParallelStrategy``) + the rollout side. ``RLModule.configure_model`` shards each
    decoder layer and the whole policy over the data-parallel ranks
    (:func:`periodic_rl.sharding.shard_policy`); pushes gather one weight at a time onto rank
    0 (:mod:`periodic_rl.weight_sync.gather`). Runs on CPUs (gloo) as well as GPUs."""

    strategy_name = "periodic_async_fsdp"
    atomic_checkpoints = False  # distributed checkpoints: a directory written by every rank

    def setup_environment(self) -> None:
        # Every rank is a data-parallel rank (Lightning's default splits tensor-parallel
        # over the processes of a node, which a plain decoder does not support).
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == "auto":
            self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        super().setup_environment()

    def gathered_weights(self) -> AbstractContextManager[Any]:
        return gathered_on_rank0(self.lightning_module, fsdp2_full_tensor, self.global_rank)


class PeriodicAsyncDeepSpeedStrategy(_LoopbackRendezvous, RolloutsMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO (stage 2: optimizer state and gradients sharded; stage 3: parameters
    too) + the rollout side. Needs CUDA and the ``deepspeed`` extra (``pip install
    periodic_rl[deepspeed]``). The gradients live in DeepSpeed's partitions, so the iteration's
    normaliser divides them through DeepSpeed's loss scale at the step, where DeepSpeed also
    clips them at the module's ``max_grad_norm`` (its config's ``gradient_clipping``; fp16 is
    refused: :mod:`periodic_rl.compat.deepspeed`). Stage 3 loads the policy (and the reference)
    partitioned over the ranks, and pushes gather one weight at a time onto rank 0
    (``GatheredParameters``)."""

    strategy_name = "periodic_async_deepspeed"
    atomic_checkpoints = False  # DeepSpeed writes its own checkpoint directory

    def setup_environment(self) -> None:
        self._with_module_clip()  # a clash with the user's config: before any model loads
        super().setup_environment()

    def _format_config(self) -> None:
        self.config = self._with_module_clip()
        super()._format_config()

    def _with_module_clip(self) -> Any:
        """The DeepSpeed config with the module's ``max_grad_norm`` as its ``gradient_clipping``
        (:func:`periodic_rl.compat.deepspeed.training_config`), once a module is attached."""
        module = self.lightning_module
        if module is None or not isinstance(self.config, dict):
            return self.config
        from periodic_rl.compat.deepspeed import training_config

        return training_config(self.config, module.hparams.get("max_grad_norm"))

    def policy_loading(self) -> AbstractContextManager[Any]:
        """Under ZeRO-3, ``from_pretrained`` partitions the policy over the ranks as it loads
        (:func:`periodic_rl.compat.deepspeed.zero3_loading`, with the run's DeepSpeed config)."""
        if not self.zero_stage_3:
            return nullcontext()
        from periodic_rl.compat.deepspeed import zero3_loading

        self._init_config_if_needed()  # batch size, precision, clipping: what zero.Init reads
        assert isinstance(self.config, dict)
        return zero3_loading(self.config)

    def gathered_weights(self) -> AbstractContextManager[Any]:
        gather = zero3_full_tensor if self.zero_stage_3 else None
        return gathered_on_rank0(self.lightning_module, gather, self.global_rank)

    def divide_gradients(self, optimizer: Any, denominator: float) -> None:
        from periodic_rl.compat.deepspeed import divide_at_next_step

        saved = divide_at_next_step(self.deepspeed_engine, denominator)
        self._divided_scale: tuple[float, float] | None = (saved, float(denominator))

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        from periodic_rl.compat.deepspeed import restore_loss_scale

        divided, self._divided_scale = getattr(self, "_divided_scale", None), None
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if divided is not None:
                restore_loss_scale(self.deepspeed_engine, *divided)


for _cls, _base in (
    (PeriodicAsyncDDPStrategy, "DDPStrategy"),
    (PeriodicAsyncFSDPStrategy, "ModelParallelStrategy"),
    (PeriodicAsyncDeepSpeedStrategy, "DeepSpeedStrategy"),
):
    _cls.__doc__ = (_cls.__doc__ or "") + _ARGS.format(rollout_args=ROLLOUT_ARGS_DOC, base=_base)

StrategyRegistry.register(
    "periodic_async_ddp", PeriodicAsyncDDPStrategy, description="Periodic-async RL, DDP trainer"
)
StrategyRegistry.register(
    "periodic_async_fsdp",
    PeriodicAsyncFSDPStrategy,
    description="Periodic-async RL, FSDP2 trainer",
)
for _stage in (2, 3):
    StrategyRegistry.register(
        f"periodic_async_deepspeed_stage_{_stage}",
        PeriodicAsyncDeepSpeedStrategy,
        description=f"Periodic-async RL, DeepSpeed ZeRO-{_stage} trainer",
        stage=_stage,
    )
