"""Lightning strategies that own the rollout side."""

from periodic_rl.strategies.periodic_async import PeriodicAsyncStrategy

__all__ = ["PeriodicAsyncStrategy"]
