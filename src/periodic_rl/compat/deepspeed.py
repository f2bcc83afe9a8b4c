"""DeepSpeed internals the ``periodic_async_deepspeed`` strategy relies on (checked against
DeepSpeed 0.16-0.18 sources; exercised on a GPU by ``benchmarks/gpu.sh``, skipped elsewhere).

Under ZeRO the accumulated gradients live in DeepSpeed's partitions, not in ``param.grad``, so
the iteration's loss normaliser (known only after the last micro-batch) cannot be applied by
dividing ``param.grad``. The ZeRO optimizers already divide every gradient by their loss scale
when they step (``unscale_and_clip_grads``), clipping included: multiplying the loss scale by
the normaliser for that one step divides the gradients exactly, then the scale is put back.
"""

from __future__ import annotations

from typing import Any


def _loss_scaler(engine: Any) -> Any:
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


def restore_loss_scale(engine: Any, saved: float) -> None:
    """Put back the loss scale :func:`divide_at_next_step` changed."""
    _loss_scaler(engine).cur_scale = saved
