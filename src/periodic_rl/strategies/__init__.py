"""Lightning strategies that own the rollout side: a training strategy + rollouts.

Registered names (``strategy:`` in YAML): ``periodic_async`` (one device), ``periodic_async_ddp``,
``periodic_async_fsdp``, ``periodic_async_deepspeed_stage_2``, ``periodic_async_deepspeed_stage_3``.
"""

from periodic_rl.strategies.distributed import (
    PeriodicAsyncDDPStrategy,
    PeriodicAsyncDeepSpeedStrategy,
    PeriodicAsyncFSDPStrategy,
)
from periodic_rl.strategies.periodic_async import PeriodicAsyncStrategy
from periodic_rl.strategies.protocol import RolloutStrategy

__all__ = [
    "PeriodicAsyncDDPStrategy",
    "PeriodicAsyncDeepSpeedStrategy",
    "PeriodicAsyncFSDPStrategy",
    "PeriodicAsyncStrategy",
    "RolloutStrategy",
]
