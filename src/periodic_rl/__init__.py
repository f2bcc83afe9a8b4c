"""periodic_rl: on-policy RL post-training with generation and training overlapped.

The public API: subclass :class:`RLModule` (or give it reward functions), feed it a
:class:`PromptDataModule`, and train with ``lightning.Trainer(strategy=PeriodicAsyncStrategy())``
or ``periodic-rl fit --config run.yaml``.
"""

from periodic_rl.data import PromptDataModule
from periodic_rl.module import RLModule, StaleRolloutError
from periodic_rl.rollout.engine import InferenceEngine
from periodic_rl.strategies import PeriodicAsyncStrategy

__all__ = [
    "InferenceEngine",
    "PeriodicAsyncStrategy",
    "PromptDataModule",
    "RLModule",
    "StaleRolloutError",
]
__version__ = "0.1.0"
