"""Weight sync: everything that turns the trainer's policy into what the rollout engines load,
and checks that it landed.

- :mod:`~periodic_rl.weight_sync.export`: the trainer side: the policy's weights under
  transformers names (LoRA merged in), or the LoRA base once and then only the adapter factors.
- :mod:`~periodic_rl.weight_sync.transport`: state dicts as numpy payloads for one ``ray.put``.
- :mod:`~periodic_rl.weight_sync.merge`: the rollout side of LoRA adapter pushes: the kept base
  and the merge of each adapter into it.
- :mod:`~periodic_rl.weight_sync.names`: a push's names checked against the model's.
- :mod:`~periodic_rl.weight_sync.fingerprint`: the exact fingerprint both sides compare.

Names are imported on first use (PEP 562): a rollout worker imports the transport before it
pins its cores, and must not import torch by importing this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "adapter_fingerprint": "periodic_rl.weight_sync.fingerprint",
    "combined_fingerprint": "periodic_rl.weight_sync.fingerprint",
    "loaded_fingerprint": "periodic_rl.weight_sync.fingerprint",
    "weights_fingerprint": "periodic_rl.weight_sync.fingerprint",
    "adapted_names": "periodic_rl.weight_sync.export",
    "lora_adapter_payload": "periodic_rl.weight_sync.export",
    "lora_base_state_dict": "periodic_rl.weight_sync.export",
    "payload_bytes": "periodic_rl.weight_sync.export",
    "policy_state_dict": "periodic_rl.weight_sync.export",
    "tied_duplicates": "periodic_rl.weight_sync.export",
    "AdapterLoader": "periodic_rl.weight_sync.merge",
    "accepts_partial": "periodic_rl.weight_sync.merge",
    "lora_delta": "periodic_rl.weight_sync.merge",
    "merge_lora": "periodic_rl.weight_sync.merge",
    "WeightNames": "periodic_rl.weight_sync.names",
    "detached_cpu": "periodic_rl.weight_sync.names",
    "fused_groups": "periodic_rl.weight_sync.names",
    "meta_model_weight_names": "periodic_rl.weight_sync.names",
    "from_payload": "periodic_rl.weight_sync.transport",
    "to_payload": "periodic_rl.weight_sync.transport",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'periodic_rl.weight_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
