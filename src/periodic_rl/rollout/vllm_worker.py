"""Functions that run inside vLLM's worker, through ``LLM.collective_rpc(fn, args=...)``.

vLLM calls ``fn(worker, *args)``. They live in an importable module (not a lambda or a closure)
so that they also work when the worker is another process and the function travels by reference
(that path needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

Weights are reloaded with the worker's ``reload_weights(weights_iterator=...)``: it takes
checkpoint-format (transformers) names and redoes vLLM's post-load processing (fusing q/k/v and
gate/up, CPU repacking). The model's own ``load_weights`` fails on the CPU backend, whose
parameters have been repacked (``'Parameter' object has no attribute 'weight_loader'``).

``reload_weights`` also takes a subset of the names (LoRA adapter pushes; vLLM 0.32,
``model_loader/reload/layerwise.py``): a layer that receives nothing keeps its tensors, but a
layer that receives only part of its weights is rebuilt with the rest left uninitialised
(``torch.empty``), so a partial push must carry whole fused layers (``q_proj`` with ``k_proj``
and ``v_proj``: ``VLLMEngine.partial_load_names``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from periodic_rl.rollout.fingerprint import weights_fingerprint


def load_weights(worker: Any, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
    """Reload the worker's model from ``state_dict`` (transformers names) and return the
    fingerprint of the tensors this worker received (in-process engine: no copy was made)."""
    fingerprint = weights_fingerprint(state_dict)
    _reload(worker, state_dict.items(), partial)
    return fingerprint


def load_weights_from_file(worker: Any, path: str, partial: bool = False) -> str:
    """Reload the worker's model from a safetensors file (the multiprocess engine's transport:
    tensors passed as ``collective_rpc`` arguments do not survive its serialisation)."""
    from safetensors.torch import load_file

    state_dict = load_file(path)
    fingerprint = weights_fingerprint(state_dict)
    _reload(worker, state_dict.items(), partial)
    return fingerprint


def packed_modules(worker: Any) -> dict[str, list[str]]:
    """The model's ``packed_modules_mapping``: which checkpoint modules vLLM fuses into one
    (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``; empty when the model has none)."""
    model = worker.model_runner.get_model()
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {fused: list(members) for fused, members in mapping.items()}


def process_id(worker: Any) -> int:
    """The worker's process id (tells an in-process engine from a multiprocess one)."""
    import os

    return os.getpid()


def _reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], partial: bool) -> None:
    # Worker.reload_weights wraps the model runner's in set_current_vllm_config, which some
    # weight loaders need; fall back to the runner for workers that lack the wrapper.
    reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
    with torch.no_grad(), _quiet(_RELOAD_LOGGERS if partial else ()):
        reload(weights_iterator=iter(list(weights)))


# A partial reload makes these warn about every weight (and layer) it was not given, each push.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


@contextmanager
def _quiet(names: Iterable[str]) -> Iterator[None]:
    """Raise the named loggers to ERROR for the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
