"""Plugging the shared-prompt backends into transformers' attention interface.

One attention function, ``periodic_rl_shared_prompt``, is registered in
``transformers.AttentionInterface`` (and a matching entry in ``AttentionMaskInterface``). While a
model is inside :func:`shared_prompt_attention`, its configs point at that name. The function then
dispatches per call:

- the call carries a :class:`SharedPromptLayout` in its kwargs (transformers forwards
  ``model(**kwargs)`` down to every attention call): shared-prompt attention with the layout's
  backend;
- it carries none but this thread is inside a shared-prompt forward (a decoder layer that does not
  pass its kwargs on to the attention, e.g. StableLM's): the layout of that forward;
- neither (an ordinary forward, generation in another thread, ...): the model's original
  attention implementation, with the original mask function, exactly as without us.

Why a dispatcher and not a plain temporary switch: with gradient checkpointing the layers run
their forward again during ``backward()``. The layout is captured with the layer's kwargs, but the
attention function is looked up from the config at that moment, so the config must still point at
a function that understands the layout. Wrap forward and backward in
``with shared_prompt_attention(model):`` in that case (``completion_logprobs`` says so if you
forget).

Models whose attention cannot take the layout are refused, not approximated: models that do not
use the interface, forwards without ``position_ids``, layers that are not attention (convolutions,
recurrences mix tokens across the packed responses), attention masks or biases built outside the
mask interface (ALiBi, dynamic masks), sliding windows shorter than prompt + response, softcapping
on a backend without it, attention sinks, position biases. :mod:`periodic_rl.attention.support`
adds a numerical probe per model on top of these checks.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    PretrainedConfig,
    PreTrainedModel,
)

from periodic_rl.attention.backends import BACKENDS, AttentionOptions
from periodic_rl.attention.layout import SharedPromptLayout
from periodic_rl.compat.transformers import (
    attention_implementation,
    original_attention_function,
    registered_mask_function,
    set_attention_implementation,
    uses_attention_interface,
)

ATTN_NAME = "periodic_rl_shared_prompt"
LAYOUT_KWARG = "shared_prompt_layout"
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
# config attributes that list the kind of every layer (the name varies by family)
LAYER_LIST_ATTRS = ("layer_types", "layers_block_type", "block_types")

# id(config) -> (weak ref to it, the attention implementation it had before we switched it).
# Keyed by id: configs define __eq__ and are unhashable.
_INNER: dict[int, tuple[weakref.ref[PretrainedConfig], str | None]] = {}
# (layout, whether layers may read it from here) while this thread runs a shared-prompt forward:
# the mask function then builds nothing, and attention calls without the layout kwarg use it
_SHARED_FORWARD: ContextVar[tuple[SharedPromptLayout, bool] | None] = ContextVar(
    "periodic_rl_shared_forward", default=None
)


class SharedPromptUnsupportedError(ValueError):
    """The model's attention cannot be computed with the shared-prompt layout."""


def _remember_inner(config: PretrainedConfig, inner: str | None) -> None:
    key = id(config)
    _INNER[key] = (weakref.ref(config, lambda _ref: _INNER.pop(key, None)), inner)


def _inner_name(config: Any) -> str | None:
    entry = _INNER.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    raise RuntimeError(
        f"attention implementation {ATTN_NAME!r} was selected outside shared_prompt_attention(); "
        "enter `with periodic_rl.attention.shared_prompt_attention(model):` instead of setting "
        "it by hand"
    )


def _delegate(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Run the model's original attention function (a forward without a layout)."""
    inner = _inner_name(module.config)
    fn = original_attention_function(module, inner)
    if fn is None:
        raise RuntimeError(f"cannot find the original attention ({inner!r}) of {type(module)}")
    return fn(module, *args, **kwargs)


def shared_prompt_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: shared-prompt attention when a layout is passed."""
    layout: SharedPromptLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if layout is None:
        active = _SHARED_FORWARD.get()
        if active is None:
            return _delegate(module, query, key, value, attention_mask, **kwargs)
        layout, from_context_ok = active
        if not from_context_ok:
            raise SharedPromptUnsupportedError(
                f"{where} does not receive the layout in its kwargs (its decoder layer does not "
                "pass them on), so the recomputation of gradient checkpointing in backward() "
                "would run plain causal attention; disable gradient checkpointing or use "
                "shared_prompt=False"
            )
    backend = BACKENDS[layout.backend]
    if attention_mask is not None:
        raise SharedPromptUnsupportedError(
            f"{where} passes an attention mask or bias of its own (built outside transformers' "
            "mask interface, e.g. ALiBi or a dynamic mask), which the shared-prompt backends "
            "cannot apply; use shared_prompt=False"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < layout.max_span:
        raise SharedPromptUnsupportedError(
            f"{where} uses a sliding window of {window} tokens, shorter than prompt + response "
            f"({layout.max_span}): the window would cut the shared prompt. Use shared_prompt=False."
        )
    softcap = kwargs.get("softcap")
    if softcap is not None and not backend.softcap:
        raise SharedPromptUnsupportedError(
            f"{where} uses attention-logit softcapping ({softcap}), which backend "
            f"{backend.name!r} cannot apply; use 'flex' or 'flash' (GPU) or shared_prompt=False"
        )
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise SharedPromptUnsupportedError(f"{where} passes {name!r}, which is not supported")
    if kwargs.get("is_causal", True) is False or not getattr(module, "is_causal", True):
        raise SharedPromptUnsupportedError(f"{where} is not causal attention")
    dropout = float(kwargs.get("dropout", 0.0) or 0.0)
    if dropout and not backend.dropout:
        raise SharedPromptUnsupportedError(
            f"{where}: attention dropout {dropout} with backend {backend.name!r}; use model.eval() "
            "or attention_dropout=0 (or another backend)"
        )
    n = layout.total_len
    if query.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n:
        raise SharedPromptUnsupportedError(
            f"{where}: expected query/key length {n} in one row, got query {tuple(query.shape)} "
            f"key {tuple(key.shape)} (a KV cache or extra tokens?)"
        )
    layout.calls += 1
    layout.consumers.add(id(module))
    opt = AttentionOptions(scaling=kwargs.get("scaling"), dropout=dropout, softcap=softcap)
    return backend.fn(query, key, value, layout, opt), None


def _shared_prompt_mask(*args: Any, **kwargs: Any) -> Any:
    """Mask function for our name: nothing during a shared forward, else the original one."""
    if _SHARED_FORWARD.get() is not None:
        return None  # the backend builds its own (small, cached) masks from the layout
    mask_function = registered_mask_function(_inner_name(kwargs.get("config")))
    if mask_function is None:
        return None  # what transformers does for implementations without a mask function
    return mask_function(*args, **kwargs)


AttentionInterface.register(ATTN_NAME, shared_prompt_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, _shared_prompt_mask)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the same modules, not a copy)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    seen: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def shared_prompt_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Point ``model``'s attention at the shared-prompt dispatcher for the duration of the block.

    Re-entrant (an inner block is a no-op). Forwards without a layout inside the block behave as
    before. Needed around ``backward()`` too when the model uses gradient checkpointing.
    """
    switched = [c for c in _configs(model) if attention_implementation(c) != ATTN_NAME]
    saved = []
    for config in switched:
        inner = set_attention_implementation(config, ATTN_NAME)
        _remember_inner(config, inner)
        saved.append((config, inner))
    try:
        yield model
    finally:
        for config, inner in saved:
            set_attention_implementation(config, inner)


def is_shared_prompt_active(model: torch.nn.Module) -> bool:
    """Whether ``model`` is inside :func:`shared_prompt_attention`."""
    configs = _configs(model)
    return bool(configs) and all(attention_implementation(c) == ATTN_NAME for c in configs)


@contextmanager
def shared_forward(layout: SharedPromptLayout, *, context_layout_ok: bool = True) -> Iterator[None]:
    """Mark this thread's forward as a shared-prompt one with ``layout``.

    The mask function then builds nothing, and attention calls that did not get the layout in their
    kwargs take it from here (refused when ``context_layout_ok`` is False: with gradient
    checkpointing, backward recomputes those layers outside this block).
    """
    token = _SHARED_FORWARD.set((layout, context_layout_ok))
    try:
        yield
    finally:
        _SHARED_FORWARD.reset(token)


@contextmanager
def refusals_name_the_model(model: torch.nn.Module) -> Iterator[None]:
    """Prefix refusals raised inside (e.g. by an attention layer) with the model's class name."""
    try:
        yield
    except SharedPromptUnsupportedError as err:
        name = type(unwrap_model(model)).__name__
        if str(err).startswith(name):
            raise
        raise SharedPromptUnsupportedError(f"{name}: {err}") from err


def accepts_kwarg(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` (the base model's, under a peft wrapper) has parameter ``name``."""
    try:
        params = inspect.signature(unwrap_model(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _takes_position_ids(base: PreTrainedModel) -> bool:
    """``position_ids`` is a parameter of the forward, or of the decoder its ``**kwargs`` reach.

    Whisper's and TrOCR-style heads take ``**kwargs`` only and hand them to a decoder that reads
    ``position_ids``; BART-family decoders have no such parameter and count positions themselves.
    """
    if accepts_kwarg(base, "position_ids"):
        return True
    try:
        params = inspect.signature(base.forward).parameters.values()
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    except Exception:  # noqa: BLE001 - no usable decoder: judge by the forward alone
        return False
    if decoder is None or decoder is base:
        return False
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return takes_kwargs and accepts_kwarg(decoder, "position_ids")


def _layer_kinds(text: PretrainedConfig) -> list[str]:
    for attr in LAYER_LIST_ATTRS:
        try:
            kinds = getattr(text, attr, None)
        except Exception:  # noqa: BLE001 - per-layer configs refuse some global reads
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds:
            return [str(k) for k in kinds]
    return []


def check_model_supported(model: torch.nn.Module, layout: SharedPromptLayout | None = None) -> None:
    """Refuse, before any compute, models whose attention cannot take a shared-prompt layout.

    ``layout`` (the packed batch about to run), when given, lets chunked attention through if
    every chunk covers prompt + response.
    """
    base = unwrap_model(model)
    name = type(base).__name__
    if not isinstance(base, PreTrainedModel):
        raise SharedPromptUnsupportedError(f"{name} is not a transformers PreTrainedModel")
    if not uses_attention_interface(type(base)):
        raise SharedPromptUnsupportedError(
            f"{name} does not use transformers' AttentionInterface, so the shared-prompt layout "
            "cannot reach its attention; use shared_prompt=False"
        )
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise SharedPromptUnsupportedError(
            "prompt-learning peft adapters (prefix/prompt tuning) add virtual tokens; use "
            "shared_prompt=False"
        )
    text = base.config.get_text_config()
    if not getattr(text, "is_causal", True):
        raise SharedPromptUnsupportedError(
            f"{name} is configured as bidirectional (is_causal=False)"
        )
    other = set(_layer_kinds(text)) - ATTENTION_LAYER_TYPES
    chunk = getattr(text, "attention_chunk_size", None)
    if "chunked_attention" in other and layout is not None and chunk and layout.max_span <= chunk:
        other.discard("chunked_attention")  # every position falls in the first chunk
    other = sorted(other)
    if other:
        raise SharedPromptUnsupportedError(
            f"{name} has layers of type {other}: only attention layers "
            f"({sorted(ATTENTION_LAYER_TYPES)}) keep packed replies apart; use shared_prompt=False"
        )
    if not _takes_position_ids(base):
        raise SharedPromptUnsupportedError(
            f"{name}.forward takes no position_ids: its positions follow the sequence index, so "
            "a response packed after another cannot restart at the prompt length; use "
            "shared_prompt=False"
        )


def check_layout_consumed(model: torch.nn.Module, layout: SharedPromptLayout) -> None:
    """After the forward: every decoder layer must have run its attention through our function."""
    text = unwrap_model(model).config.get_text_config()
    expected = getattr(text, "num_hidden_layers", None)
    modules = len(layout.consumers)
    # one module per layer; a layer may call it twice (DiffLlama), a model may loop over its
    # layers (HRM: num_hidden_layers counts the calls)
    if layout.calls == 0 or (
        expected is not None and modules < expected and layout.calls != expected
    ):
        raise SharedPromptUnsupportedError(
            f"{type(unwrap_model(model)).__name__}: {layout.calls} attention calls from "
            f"{modules} attention modules used the shared-prompt layout, expected at least one "
            f"module per layer ({expected}). Some layers do not go through transformers' "
            "AttentionInterface (or another thread restored the attention implementation "
            "mid-forward); their result would be wrong. Use shared_prompt=False."
        )


def needs_checkpoint_session(model: torch.nn.Module) -> bool:
    """Whether this forward will recompute layers in backward (gradient checkpointing, training)."""
    base = unwrap_model(model)
    return bool(
        getattr(base, "is_gradient_checkpointing", False)
        and base.training
        and torch.is_grad_enabled()
    )
