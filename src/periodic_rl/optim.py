"""The optimizer and learning-rate schedule of :class:`~periodic_rl.RLModule`.

AdamW over the trainable parameters (torch's fused kernel where every parameter and the precision
plugin allow it, ``bf16-mixed`` included: one pass over each tensor instead of one per
arithmetic operation; transformers'
``adamw_torch_fused`` default), with one of transformers' schedules
(``transformers.get_scheduler``: ``linear``, ``cosine``, ``cosine_with_min_lr``,
``constant_with_warmup``, ``polynomial``, ...), the ones TRL's ``lr_scheduler_type`` names. The
number of training steps is Lightning's ``trainer.estimated_stepping_batches`` (``max_steps``,
or the epochs' batches): one iteration is one optimizer step.

Manual optimization: Lightning does not step schedulers then, so the module steps every
scheduler it was given (:func:`step_schedulers`) right after ``optimizer.step()``, once per
iteration. Lightning still saves their state in checkpoints and restores it on resume, so a
resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import torch

# Schedules get_scheduler offers that make no sense here: one needs a monitored metric, one is
# not a learning-rate schedule.
REFUSED = ("reduce_lr_on_plateau", "greedy")

#: The ``lr_scheduler`` values: ``transformers.get_scheduler``'s names but :data:`REFUSED`
#: (``tests/test_config_checks.py`` checks the list against the installed transformers).
LRScheduler = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
]


def scheduler_names() -> list[str]:
    """The accepted ``lr_scheduler`` values."""
    return list(get_args(LRScheduler))


def check_schedule(
    lr_scheduler: str, warmup_steps: int, warmup_ratio: float, kwargs: dict[str, Any] | None
) -> None:
    """Refuse bad warm-up or schedule arguments at construction, naming the field and the
    fix (the name itself is checked against :data:`LRScheduler` with the other choices)."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
    if lr_scheduler == "constant" and (warmup_steps or warmup_ratio):
        raise ValueError(
            "lr_scheduler 'constant' has no warm-up; use 'constant_with_warmup' with "
            "warmup_steps / warmup_ratio"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("lr_scheduler_kwargs must be a dict, or null")


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes every one of ``params``: plain floating-point tensors
    on a device it has fused kernels for. Tensor subclasses (FSDP2's ``DTensor``) and meta
    tensors keep torch's default implementation."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.is_floating_point()
        and p.device.type in devices
        for p in params
    )


def fused_allowed(module: Any) -> bool:
    """Whether the run's precision plugin takes a fused optimizer: the plain plugins
    (``32-true``, ``bf16-true``, ``64-true``) and ``bf16-mixed``, which has no loss scaler.
    Under a scaler (``16-mixed``) the fused kernel unscales the gradients inside its ``step``,
    after clipping would have read them; FSDP's plugin and DeepSpeed (which wraps the optimizer
    itself) keep torch's default."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision

    trainer = getattr(module, "_trainer", None)
    plugin = getattr(trainer, "precision_plugin", None)
    unscaled_amp = _unscaled_amp(plugin)
    return unscaled_amp or type(plugin) in (Precision, HalfPrecision, DoublePrecision)


def _unscaled_amp(plugin: Any) -> bool:
    """Lightning's AMP plugin without a loss scaler (``bf16-mixed``)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return type(plugin) is MixedPrecision and plugin.scaler is None


def clip_gradients(module: Any, optimizer: Any, max_norm: float) -> None:
    """Clip the gradients' total norm to ``max_norm`` through the precision plugin.

    Lightning's AMP plugin refuses any optimizer whose ``step`` would unscale the gradients
    (fused AdamW), since clipping scaled gradients is wrong. ``bf16-mixed`` has no scaler, so
    there its base class's clipping (``torch.nn.utils.clip_grad_norm_`` over the optimizer's
    parameters) is exactly right and the fused kernel stays.
    """
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType

    plugin = module.trainer.precision_plugin
    if _unscaled_amp(plugin):
        Precision.clip_gradients(plugin, optimizer, max_norm, GradClipAlgorithmType.NORM)
    else:
        module.clip_gradients(optimizer, max_norm, "norm")


def configure_optimizers(module: Any) -> Any:
    """AdamW over the policy's trainable parameters, and the schedule when it is not constant
    (a constant rate needs no scheduler, and old checkpoints hold none)."""
    h = module.hparams
    params = [p for p in module.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=h.learning_rate,
        weight_decay=h.weight_decay,
        fused=(fused_supported(params) and fused_allowed(module)) or None,  # None: torch's own
    )
    name = h.lr_scheduler
    if name == "constant":
        return optimizer
    total = module.trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ValueError(
            f"lr_scheduler {name!r} decays over the run's length: set trainer.max_steps "
            "(or max_epochs with a sized prompt loader)"
        )
    total = int(total)
    warmup = h.warmup_steps or math.ceil(h.warmup_ratio * total)
    from transformers import get_scheduler

    scheduler = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=dict(h.lr_scheduler_kwargs or {}),
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def step_schedulers(module: Any) -> None:
    """Step every scheduler once (one optimizer step per iteration). A ``ReduceLROnPlateau``
    (from an overridden ``configure_optimizers``) needs a metric: step it yourself."""
    schedulers = module.lr_schedulers()
    if schedulers is None:
        return
    for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
