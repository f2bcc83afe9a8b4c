"""A full weight push into a vLLM CPU model, without vLLM's layer-wise reload machinery.

vLLM's in-place reload (``worker.reload_weights``) serves every model, device and partial push,
and pays for it on each push: it puts every layer back on the meta device, runs each weight
loader a first time on meta tensors only to count elements, gives every layer fresh memory (the
embedding twice: a fresh copy, then the copy back into the live tensor), and then packs (vLLM's
CPU linears keep their weights only as oneDNN-packed buffers). For a full push of an unquantised
model on the CPU, :class:`FastReload` does the same loading and packing with less around it:

- each linear layer loads into a staging buffer from a pool kept across layers and pushes (no
  fresh memory, no page faults), through vLLM's own weight loaders (which fuse q/k/v and
  gate/up), and is packed by vLLM's own ``process_weights_after_loading`` as soon as all its
  elements arrived;
- a linear whose loader would be one plain copy (``RowParallelLinear``, ``ColumnParallelLinear``
  without tensor parallelism: o_proj, down_proj) is packed straight from the pushed tensor
  when dtype, shape and strides match (the pack copies; nothing keeps the pushed tensor);
- embeddings and norms load in place through their own loaders (one copy); the embedding is
  packed once for its tied head, which takes the same kernel (as
  :func:`periodic_rl.compat.vllm.refresh_tied_heads` does after vLLM's reload).

The kernels are those vLLM's reload builds, bit for bit (``tests/rollout/test_vllm_engine.py``); the
reload is faster (docs/overlap.md). A model it cannot serve (not the CPU, compiled, tensor parallel,
quantised, a linear with a bias, a layer vLLM recorded no reload metadata for) gets ``None`` from
:func:`fast_reload_for`, and vLLM's reload is used; so is it for partial pushes, and when
``PERIODIC_RL_VLLM_FAST_RELOAD=0``.

Relies on vllm 0.32.0 internals: ``reload.layerwise.LAYERWISE_INFO`` (each layer's
checkpoint-layout parameters on the meta device, with their loaders, recorded at load time) and
``_get_original_loader``; ``reload.sanitize.restore_layer_refs`` / ``layer_ref_sentinel``;
``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod.process_weights_after_loading`` on the
CPU (``dispatch_cpu_unquantized_gemm``: ``layer.cpu_linear`` holds the packed weight, a linear's
``weight`` becomes an empty parameter, an embedding keeps its ``weight``); loaders called as
``param.weight_loader(param, tensor[, shard_id])``; the model runner's ``reset_lora_state``,
``reset_encoder_cache``, ``reset_mm_cache`` (what its ``reload_weights`` calls after loading).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

#: Set to ``0`` to push through vLLM's own in-place reload always.
ENV_SWITCH = "PERIODIC_RL_VLLM_FAST_RELOAD"

_FOR_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, FastReload | None] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Linear:
    """A linear layer to stage: its checkpoint-layout weight on the meta device (shape, strides,
    loader) and whether its loader is one plain copy (packed from the pushed tensor)."""

    module: torch.nn.Module
    meta: torch.Tensor
    plain_copy: bool


@dataclass
class FastReload:
    """The fast full reload of one vLLM model (module docstring): :func:`fast_reload_for`."""

    model: torch.nn.Module
    linears: list[_Linear]
    #: Each embedding owning its weight, with the heads tied to it (found once: the reload
    #: loads in place, so which module holds which weight never changes).
    embeddings: list[tuple[torch.nn.Module, list[torch.nn.Module]]]
    _pool: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)

    def reload(self, worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Load every weight (a full state dict, transformers names) and pack; returns what
        ``model.load_weights`` returns (the loaded parameter names)."""
        from vllm.config import set_current_vllm_config

        unfinished: dict[int, torch.Tensor] = {}  # id of a staged layer -> its placeholder
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            for linear in self.linears:
                self._stage(linear, unfinished)
            try:
                loaded = self.model.load_weights(weights)
            finally:
                if unfinished:  # loading failed, or the push was not full
                    self._unstage(unfinished)
            if unfinished:
                raise RuntimeError(
                    f"a full weight push left {len(unfinished)} linear layer(s) of vLLM's model "
                    "incomplete: the engine holds old and new weights mixed"
                )
            self._pack_embeddings()
        runner = worker.model_runner
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        return loaded

    def _stage(self, linear: _Linear, unfinished: dict[int, torch.Tensor]) -> None:
        """Register a staging parameter on ``linear``: vLLM's loaders fill it, the last of them
        packs it (``_pack``)."""
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

        module, meta = linear.module, linear.meta
        placeholder = module._parameters["weight"]  # empty: the weights live in the kernel
        buffer = self._take(meta)
        staged = _parameter_like(buffer, meta, module)
        loader = _get_original_loader(meta)
        if isinstance(loader, MethodType) and loader.__self__ is layer_ref_sentinel:
            loader = loader.__func__.__get__(module)
        state: dict[str, Any] = {"loaded": 0, "pushed": None}

        def staged_loader(param: torch.Tensor, pushed: torch.Tensor, *args: Any, **kw: Any) -> None:
            if linear.plain_copy and not args and not kw and _same_layout(pushed, staged):
                state["pushed"] = pushed  # packed from it below: no copy into the buffer
            else:
                loader(param, pushed, *args, **kw)
            state["loaded"] += pushed.numel()  # no tensor parallelism: a call fills all of it
            if state["loaded"] >= meta.numel():
                source = staged if state["pushed"] is None else state["pushed"]
                self._pack(module, _parameter_like(source, meta, module), placeholder)
                self._give(buffer)
                unfinished.pop(id(module), None)

        staged.weight_loader = staged_loader
        module._parameters["weight"] = staged
        unfinished[id(module)] = placeholder

    @staticmethod
    def _pack(module: torch.nn.Module, weight: torch.Tensor, placeholder: torch.Tensor) -> None:
        module._parameters["weight"] = weight
        module.quant_method.process_weights_after_loading(module)
        if module._parameters["weight"].numel():  # the kernel would read the staging buffer
            raise RuntimeError(
                f"vLLM kept the weight of {type(module).__name__} after packing it; set "
                f"{ENV_SWITCH}=0 to push through vLLM's own reload"
            )
        module._parameters["weight"] = placeholder  # the same empty tensor as before

    def _unstage(self, unfinished: dict[int, torch.Tensor]) -> None:
        """Put back the placeholders of the layers a failed load left staged (their kernels
        still hold the previous weights)."""
        for linear in self.linears:
            placeholder = unfinished.get(id(linear.module))
            if placeholder is not None:
                linear.module._parameters["weight"] = placeholder

    def _pack_embeddings(self) -> None:
        """Pack each embedding once (its old kernels released first, so the allocator may
        reuse their memory) and give its tied heads the same kernel."""
        for embedding, tied in self.embeddings:
            for module in (embedding, *tied):
                module.cpu_linear = None
            embedding.quant_method.process_weights_after_loading(embedding)
            for module in tied:
                module.cpu_linear = embedding.cpu_linear

    def _take(self, meta: torch.Tensor) -> torch.Tensor:
        free = self._pool.get(_layout(meta))
        if free:
            return free.pop()
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)

    def _give(self, buffer: torch.Tensor) -> None:
        self._pool.setdefault(_layout(buffer), []).append(buffer)


def fast_reload_for(worker: Any) -> FastReload | None:
    """The worker model's :class:`FastReload` (made once per model), or ``None`` where vLLM's
    own reload must serve (module docstring)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    model = worker.model_runner.get_model()
    if model not in _FOR_MODEL:
        _FOR_MODEL[model] = _plan(worker, model)
    return _FOR_MODEL[model]


def _plan(worker: Any, model: torch.nn.Module) -> FastReload | None:
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.platforms import current_platform

    config = worker.vllm_config
    if not current_platform.is_cpu() or not config.model_config.enforce_eager:
        return None
    if config.parallel_config.world_size != 1 or config.lora_config is not None:
        return None
    linears, embeddings = [], []
    holders: dict[int, list[torch.nn.Module]] = {}  # id of a weight -> the modules holding it
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = module._parameters.get("weight")
        if isinstance(method, UnquantizedLinearMethod):
            info = LAYERWISE_INFO.get(module)
            meta = info.restore_metadata[0].get("weight") if info is not None else None
            if (
                meta is None
                or weight is None
                or weight.numel()  # kept unpacked: the kernel reads the parameter itself
                or getattr(module, "bias", None) is not None
                or getattr(module, "_cpu_skip_gemm_dispatch", False)
            ):
                return None
            plain = type(module) in (RowParallelLinear, ColumnParallelLinear)
            linears.append(_Linear(module, meta, plain))
        elif isinstance(method, UnquantizedEmbeddingMethod):
            if weight is not None and id(weight) not in holders:
                embeddings.append(module)
        elif method is not None:
            return None
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    tied = [  # each embedding with the heads that share its weight (and its CPU kernel)
        (e, [m for m in holders[id(e.weight)] if m is not e and hasattr(m, "cpu_linear")])
        for e in embeddings
    ]
    return FastReload(model, linears, tied) if linears else None


def _parameter_like(data: torch.Tensor, meta: torch.Tensor, module: torch.nn.Module) -> Any:
    """A parameter object on ``data``'s storage with the class and attributes of vLLM's recorded
    ``meta`` parameter (its loaders bound to ``module``), as vLLM's reload materialises one."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    param = data.detach()
    param.__class__ = meta.__class__
    param.__dict__ = meta.__dict__.copy()
    return restore_layer_refs(param, module)


def _layout(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def _same_layout(pushed: torch.Tensor, staged: torch.Tensor) -> bool:
    return _layout(pushed) == _layout(staged) and pushed.device == staged.device


def recording(weights: Iterable[tuple[str, torch.Tensor]], fed: dict) -> Iterator:
    """``weights``, each pair kept in ``fed`` as it is pulled."""
    for name, tensor in weights:
        fed[name] = tensor
        yield name, tensor
