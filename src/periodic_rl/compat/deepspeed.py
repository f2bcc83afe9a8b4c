"""DeepSpeed internals the ``periodic_async_deepspeed`` strategy relies on (read against the
DeepSpeed 0.19.8 sources, ``runtime/engine.py``, ``runtime/zero/stage_1_and_2.py``,
``runtime/zero/stage3.py``, ``runtime/fp16/loss_scaler.py``, and transformers 5.19's
``integrations/deepspeed.py``; exercised on a GPU by ``tests/compat/test_deepspeed.py``,
skipped elsewhere).

- **The iteration's normaliser.** Under ZeRO the accumulated gradients live in DeepSpeed's
  partitions, not in ``param.grad``, so the normaliser (known only after the last micro-batch)
  cannot be applied by dividing ``param.grad``. The ZeRO optimizers divide every gradient by
  their loss scale when they step (``unscale_and_clip_grads``), after the clip has read the
  norm divided by that same scale: multiplying the loss scale by the normaliser for that one
  step divides the gradients exactly, clipping included, then the scale is put back.
- **Clipping.** DeepSpeed clips inside that step, at its config's ``gradient_clipping``, which
  Lightning fills from ``Trainer(gradient_clip_val=...)``; manual optimisation leaves that unset
  (0: off), and Lightning's ``DeepSpeedPrecision.clip_gradients`` does nothing. The module's
  ``max_grad_norm`` therefore has to be the config's ``gradient_clipping``
  (:func:`training_config`).
- **fp16.** With ``fp16.enabled`` the dynamic loss scaler changes the scale inside the step
  (down on an overflow, up every ``loss_scale_window`` steps); fp16 training is refused
  (:func:`training_config`, :func:`periodic_rl.config_checks.check_precision`), and
  :func:`restore_loss_scale` keeps whatever change the scaler made.
- **ZeRO-3 loading.** transformers' ``from_pretrained`` builds a model under
  ``deepspeed.zero.Init`` (each rank materialises only its partition) only while a
  ``transformers.integrations.HfDeepSpeedConfig`` of stage 3 is alive: it keeps a weak
  reference to it (:func:`zero3_loading`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol


class LossScaler(Protocol):
    """What is used of a ZeRO optimizer's ``loss_scaler`` (``LossScaler``,
    ``DynamicLossScaler``): the scale ``step`` divides the gradients by."""

    cur_scale: float


def training_config(config: Mapping[str, Any], max_grad_norm: float | None) -> dict[str, Any]:
    """``config`` (a DeepSpeed config) with the module's ``max_grad_norm`` as its
    ``gradient_clipping`` (``None``: 0, off), for the ZeRO step to clip the iteration's
    normalised gradients.

    Raises:
        ValueError: ``config`` enables fp16, or sets a ``gradient_clipping`` of its own that is
            not ``max_grad_norm``.
    """
    fp16 = config.get("fp16")
    if isinstance(fp16, Mapping) and fp16.get("enabled", False):
        raise ValueError(
            "the DeepSpeed config enables fp16 (fp16.enabled), which periodic_async_deepspeed "
            "does not support: its dynamic loss scaler changes the scale the iteration's "
            "gradients are divided by. Use bf16 (Trainer(precision='bf16-mixed'), or "
            '"bf16": {"enabled": true} in the config) or fp32, and remove fp16.enabled'
        )
    clip = 0.0 if max_grad_norm is None else float(max_grad_norm)
    own = config.get("gradient_clipping")
    if own is not None and float(own) != clip:
        raise ValueError(
            f"the DeepSpeed config sets gradient_clipping={own}, but the module's max_grad_norm "
            f"is {max_grad_norm} (DeepSpeed clips at the module's max_grad_norm, null: off): "
            "remove gradient_clipping from the DeepSpeed config and set RLModule(max_grad_norm="
            "...) instead"
        )
    return {**config, "gradient_clipping": clip}


def _loss_scaler(engine: Any) -> LossScaler:
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    if scaler is None or not hasattr(scaler, "cur_scale"):
        raise NotImplementedError(
            f"periodic_async_deepspeed divides the iteration's gradients through the ZeRO "
            f"optimizer's loss scale, and {type(getattr(engine, 'optimizer', None)).__name__} "
            "has none (DeepSpeed's bf16 optimizer without ZeRO, or ZeRO stage 0). Use ZeRO "
            "stage 2 or 3 (zero_optimization.stage), or periodic_async_ddp / periodic_async_fsdp"
        )
    return scaler


def divide_at_next_step(engine: Any, denominator: float) -> float:
    """Make the engine's next optimizer step divide the gradients by ``denominator``; returns
    the loss scale to restore with :func:`restore_loss_scale` after that step.

    Relies on ``engine.optimizer.loss_scaler.cur_scale`` (DeepSpeedZeroOptimizer,
    DeepSpeedZeroOptimizer_Stage3), which ``step`` divides the gradients by.
    """
    scaler = _loss_scaler(engine)
    saved = float(scaler.cur_scale)
    scaler.cur_scale = saved * float(denominator)
    return saved


def restore_loss_scale(engine: Any, saved: float, denominator: float) -> None:
    """Undo :func:`divide_at_next_step` after the step, keeping what the step's loss scaler did.

    If the scale is still the one set (``saved * denominator``), ``saved`` is put back. A
    dynamic scaler may have changed it inside the step (backed off after an overflow, or grown
    after ``loss_scale_window`` clean steps): then its new value divided by ``denominator`` is
    the scaler's own change applied to ``saved``, and that is kept (not below the scale's floor,
    ``min_scale``, when the scaler has one).
    """
    scaler = _loss_scaler(engine)
    current = float(scaler.cur_scale)
    if current == saved * float(denominator):
        scaler.cur_scale = saved
        return
    floor = float(getattr(scaler, "min_scale", 0.0))
    scaler.cur_scale = max(current / float(denominator), floor)


def is_zero3(config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config runs ZeRO stage 3 (parameters partitioned)."""
    zero = (config or {}).get("zero_optimization")
    return isinstance(zero, Mapping) and zero.get("stage") == 3


@contextmanager
def zero3_loading(config: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, ``from_pretrained`` partitions each model it loads over the ranks as
    it loads (``deepspeed.zero.Init`` with ``config``) when ``config`` is ZeRO stage 3; other
    configs change nothing.

    transformers finds the config through a weak reference to a ``HfDeepSpeedConfig``: the one
    made here stays alive for the block, and is unset at its end, so that models loaded later
    (the in-process rollout engine, a reward model) load whole.
    """
    if not is_zero3(config):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(dict(config))  # registers itself (a weak reference)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_config
