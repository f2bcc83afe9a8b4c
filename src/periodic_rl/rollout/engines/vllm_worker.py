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

import time
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch

from periodic_rl.compat.vllm import (
    packed_modules_mapping,
    quiet_reload_warnings,
    reload_worker_weights,
    worker_model,
    worker_quantization,
)
from periodic_rl.weight_sync.fingerprint import loaded_fingerprint
from periodic_rl.weight_sync.transport import same_tensor_key


def load_weights(
    worker: Any, state_dict: dict[str, torch.Tensor], partial: bool = False
) -> tuple[str, dict[str, float]]:
    """Reload the worker's model from ``state_dict`` (transformers names) and return the
    fingerprint of what the reload took in and what vLLM holds after it (:func:`_verified`),
    with the seconds of both steps (``reload_s``, ``verify_s``)."""
    began = time.perf_counter()
    tied = tied_aliases(worker, state_dict)
    fed, loaded = _reload(worker, [(n, t) for n, t in state_dict.items() if n not in tied], partial)
    fed.update({name: state_dict[name] for name in tied})  # hashed as read back: one tensor
    reloaded = time.perf_counter()
    fingerprint = _verified(worker, state_dict, fed, loaded, partial)
    timings = {"reload_s": reloaded - began, "verify_s": time.perf_counter() - reloaded}
    return fingerprint, timings


def load_weights_from_file(
    worker: Any, path: str, partial: bool = False
) -> tuple[str, dict[str, float]]:
    """Reload the worker's model from a safetensors file (the multiprocess engine's transport:
    tensors passed as ``collective_rpc`` arguments do not survive its serialisation)."""
    from safetensors.torch import load_file

    return load_weights(worker, load_file(path), partial)


def _verified(
    worker: Any,
    received: dict[str, torch.Tensor],
    fed: dict[str, torch.Tensor],
    loaded: set[str] | None,
    partial: bool,
) -> str:
    """The fingerprint a vLLM worker reports after a reload, and the checks behind it.

    vLLM's CPU backend repacks the linear layers (their parameters are left empty, the packed
    weights live in kernel-private buffers), and fuses q/k/v and gate/up, so most of what it
    holds cannot be read back under transformers names. What is verified instead:

    - every tensor is hashed as vLLM's own loader (``model.load_weights``) pulled it from the
      reload's iterator (``fed``): a tensor received but never handed to vLLM, or changed on the
      way, changes the fingerprint;
    - parameters vLLM keeps in checkpoint layout (same name and shape: embeddings, norms) are
      hashed as read back from the model after the reload, not as sent;
    - after a full load, vLLM's loader must report every parameter of the model loaded (vLLM
      itself only logs a warning), else ``RuntimeError``.

    The repacking itself is trusted (tests compare log-probs after a push with the trainer's).
    """
    model = worker_model(worker)
    if not partial and loaded is not None and worker_quantization(worker) is None:
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise RuntimeError(
                f"vLLM's reload left {len(missing)} parameter(s) unloaded: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
    params = dict(model.named_parameters(remove_duplicate=False))
    held = {}
    for name, tensor in fed.items():
        own = params.get(name)
        held[name] = own if own is not None and own.shape == tensor.shape else tensor
    return loaded_fingerprint(received, held)


def tied_aliases(worker: Any, state_dict: dict[str, torch.Tensor]) -> set[str]:
    """Names of ``state_dict`` vLLM need not load: the tensor arrived under an earlier name
    too, and vLLM's model ties both names to one parameter (a tied ``lm_head.weight``).

    Fed twice, vLLM's reload processes the embedding twice (a fresh copy and, on the CPU, a
    oneDNN repack of the whole vocabulary each time). The fingerprint still covers such a name,
    read back from the tied parameter after the reload."""
    params = dict(worker_model(worker).named_parameters(remove_duplicate=False))
    first: dict[tuple, str] = {}
    tied = set()
    for name, tensor in state_dict.items():
        key = same_tensor_key(tensor)
        earlier = first.setdefault(key, name) if key is not None else name
        param = params.get(name)
        if earlier != name and param is not None and param is params.get(earlier):
            tied.add(name)
    return tied


def packed_modules(worker: Any) -> dict[str, list[str]]:
    """The model's ``packed_modules_mapping``: which checkpoint modules vLLM fuses into one
    (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``; empty when the model has none)."""
    return packed_modules_mapping(worker_model(worker))


def process_id(worker: Any) -> int:
    """The worker's process id (tells an in-process engine from a multiprocess one)."""
    import os

    return os.getpid()


def _reload(
    worker: Any, weights: Iterable[tuple[str, torch.Tensor]], partial: bool
) -> tuple[dict[str, torch.Tensor], set[str] | None]:
    """Reload in place; returns the ``(name, tensor)`` pairs vLLM's ``model.load_weights``
    pulled from the iterator, and the parameter names it reported loaded (``None``: none).
    A partial reload makes vLLM warn about every weight (and layer) it was not given, each
    push: those warnings are silenced."""
    with quiet_reload_warnings() if partial else nullcontext():
        return reload_worker_weights(worker, weights, full=not partial)
