"""`PeriodicAsyncStrategy`: one training device + the rollout side.

The multi-device variants (DDP, FSDP, DeepSpeed) are in :mod:`periodic_rl.strategies.
distributed`; the rollout side they share is :class:`~periodic_rl.strategies.rollouts_mixin.
RolloutsMixin`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry

from periodic_rl.strategies.rollouts_mixin import ROLLOUT_ARGS_DOC, RolloutsMixin


class PeriodicAsyncStrategy(RolloutsMixin, SingleDeviceStrategy):
    """Train on one device while rollout workers generate, staying exactly on-policy.

    Args:
        device: the training device, e.g. ``cuda:1``. Default: the Trainer's, from its
            ``accelerator`` (``Trainer(accelerator="gpu", devices=1)`` trains on ``cuda:0``).
            ``devices`` above 1 is refused: use ``periodic_async_ddp`` (or ``_fsdp``,
            ``_deepspeed_stage_2/3``) for several training devices.{rollout_args}
    """

    strategy_name = "periodic_async"

    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        super().__init__(device=torch.device(device or "cpu"), **kwargs)
        self._device = torch.device(device) if device is not None else None
        self._parallel_devices: list[torch.device] | None = None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices the Trainer's accelerator connector picked; this strategy trains on one."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"PeriodicAsyncStrategy trains on one device, but the Trainer asks for "
                f"{len(devices)} ({', '.join(str(d) for d in devices)}). For several training "
                "devices use strategy: periodic_async_ddp (or periodic_async_fsdp, "
                "periodic_async_deepspeed_stage_2/3); for one, set Trainer(devices=1) (YAML: "
                "trainer.devices: 1). The rollout workers take their own GPUs through "
                "gpus_per_worker (docs/scaling.md)."
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


PeriodicAsyncStrategy.__doc__ = PeriodicAsyncStrategy.__doc__.format(rollout_args=ROLLOUT_ARGS_DOC)

StrategyRegistry.register(
    PeriodicAsyncStrategy.strategy_name,
    PeriodicAsyncStrategy,
    description="Periodic-asynchrony RL on one training device",
)
