"""periodic_rl: on-policy RL post-training with generation and training overlapped.

The public API: subclass :class:`RLModule` (or give it reward functions), feed it a
:class:`PromptDataModule`, and train with ``lightning.Trainer(strategy="periodic_async")`` (or
``strategy=PeriodicAsyncStrategy(...)``) or ``periodic-rl fit --config run.yaml``.

Importing the package registers the strategy names (``periodic_async``, ``periodic_async_ddp``,
...) with Lightning, so a Trainer can name them right after ``import periodic_rl``. A rollout
worker does not train and must not pay for importing Lightning: its process runs with
:data:`ROLLOUT_WORKER_ENV` set (the workers' Ray runtime environment sets it), and there the
registration is skipped. Every other name is imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_EXPORTS = {
    "RLModule": "periodic_rl.module",
    "AgentConfig": "periodic_rl.agents.config",
    "Environment": "periodic_rl.agents.environment",
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

#: Set (to ``1``) in the environment of a process that only generates: a rollout worker, its
#: engine's child processes, an engine measurement. ``import periodic_rl`` there skips
#: registering the strategy names, and so does not import Lightning.
ROLLOUT_WORKER_ENV = "PERIODIC_RL_ROLLOUT_WORKER"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'periodic_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


# Known third-party messages that say nothing to a user (docs/troubleshooting.md names them).
importlib.import_module("periodic_rl.compat.noise").quiet_known_noise()

if os.environ.get(ROLLOUT_WORKER_ENV) != "1":
    # Lightning's StrategyRegistry has no entry points: the names exist once these modules ran.
    importlib.import_module("periodic_rl.strategies")
