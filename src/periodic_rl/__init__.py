"""periodic_rl: on-policy RL post-training with generation and training overlapped.

The public API: subclass :class:`RLModule` (or give it reward functions), feed it a
:class:`PromptDataModule`, and train with ``lightning.Trainer(strategy=PeriodicAsyncStrategy())``
or ``periodic-rl fit --config run.yaml``.

Names are imported on first use (PEP 562), so a rollout worker that only needs the engines does
not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RLModule": "periodic_rl.module",
    "StaleRolloutError": "periodic_rl.on_policy",
    "PeriodicAsyncStrategy": "periodic_rl.strategies.periodic_async",
    "PeriodicAsyncDDPStrategy": "periodic_rl.strategies.distributed",
    "PeriodicAsyncFSDPStrategy": "periodic_rl.strategies.distributed",
    "PeriodicAsyncDeepSpeedStrategy": "periodic_rl.strategies.distributed",
    "PromptDataModule": "periodic_rl.data.datamodule",
    "InferenceEngine": "periodic_rl.rollout.engine",
    "HFEngine": "periodic_rl.rollout.engines.hf_engine",
    "VLLMEngine": "periodic_rl.rollout.engines.vllm_engine",
    "RayRollouts": "periodic_rl.rollout.workers.rollouts",
    "HardwareTuning": "periodic_rl.rollout.tuning",
    "CPUTuning": "periodic_rl.cpu_tuning",
    "run_python": "periodic_rl.sandbox",
    "SandboxResult": "periodic_rl.sandbox",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'periodic_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
