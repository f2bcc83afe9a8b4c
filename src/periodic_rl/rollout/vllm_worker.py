"""Functions that run inside vLLM's worker, through ``LLM.collective_rpc(fn, args=...)``.

vLLM calls ``fn(worker, *args)``. They live in an importable module (not a lambda or a closure)
so that they also work when the worker is another process and the function travels by reference
(that path needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

Weights are reloaded with the worker's ``reload_weights(weights_iterator=...)``: it takes
checkpoint-format (transformers) names and redoes vLLM's post-load processing (fusing q/k/v and
gate/up, CPU repacking). The model's own ``load_weights`` fails on the CPU backend, whose
parameters have been repacked (``'Parameter' object has no attribute 'weight_loader'``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from periodic_rl.rollout.fingerprint import weights_fingerprint


def load_weights(worker: Any, state_dict: dict[str, torch.Tensor]) -> str:
    """Reload the worker's model from ``state_dict`` (transformers names) and return the
    fingerprint of the tensors this worker received (in-process engine: no copy was made)."""
    fingerprint = weights_fingerprint(state_dict)
    _reload(worker, state_dict.items())
    return fingerprint


def load_weights_from_file(worker: Any, path: str) -> str:
    """Reload the worker's model from a safetensors file (the multiprocess engine's transport:
    tensors passed as ``collective_rpc`` arguments do not survive its serialisation)."""
    from safetensors.torch import load_file

    state_dict = load_file(path)
    fingerprint = weights_fingerprint(state_dict)
    _reload(worker, state_dict.items())
    return fingerprint


def process_id(worker: Any) -> int:
    """The worker's process id (tells an in-process engine from a multiprocess one)."""
    import os

    return os.getpid()


def _reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    # Worker.reload_weights wraps the model runner's in set_current_vllm_config, which some
    # weight loaders need; fall back to the runner for workers that lack the wrapper.
    reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
    with torch.no_grad():
        reload(weights_iterator=iter(list(weights)))
