"""transformers internals the shared-prompt attention relies on (checked on transformers 5.19.0).

Pinned by ``tests/compat/test_transformers.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def attention_implementation(config: Any) -> str | None:
    """The attention implementation ``config`` selects: the name its attention layers look up in
    ``ALL_ATTENTION_FUNCTIONS`` at every call.

    Relies on the private property ``PretrainedConfig._attn_implementation`` (transformers
    5.19.0), read by each modeling file's attention forward.
    """
    return config._attn_implementation


def set_attention_implementation(config: Any, name: str | None) -> str | None:
    """Select attention ``name`` for ``config`` alone (not its sub-configs), with no check and no
    kernel loading; returns the name it held before (``None`` when unset).

    Writes the private field ``PretrainedConfig._attn_implementation_internal``, which
    ``_attn_implementation`` returns (transformers 5.19.0). The public
    ``model.set_attn_implementation`` validates the name and loads kernels, and the
    ``_attn_implementation`` setter recurses into sub-configs; a temporary switch of every
    config of a model, each restored to its own value, needs neither.
    """
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = name
    return previous


def uses_attention_interface(model_class: type) -> bool:
    """Whether ``model_class`` computes its attention through ``AttentionInterface`` (so an
    attention implementation registered there reaches every layer).

    Relies on the private classmethod ``PreTrainedModel._can_set_attn_implementation()``
    (transformers 5.19.0: a heuristic on the modeling file's source, cached in
    ``_can_set_attn_implementation_cached_value``).
    """
    return bool(model_class._can_set_attn_implementation())


def registered_mask_function(name: str | None) -> Callable[..., Any] | None:
    """The mask function transformers builds masks with for attention implementation ``name``;
    ``None`` when it builds none (an implementation registered without a mask function).

    Relies on the private class mapping ``AttentionMaskInterface._global_mapping`` of
    ``transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS``: transformers 5.19.0's
    ``masking_utils._preprocess_mask_arguments`` checks membership there, and creates no mask
    for a name that is absent.
    """
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[name]


def original_attention_function(module: Any, name: str | None) -> Callable[..., Any] | None:
    """The function the attention layer ``module`` would call for implementation ``name``.

    Relies on two undocumented conventions of transformers 5.19.0's modeling files: each one
    defines a module-level ``eager_attention_forward``, and its attention forward resolves
    ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``
    (``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS``).
    """
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def decoder_layer_classes(model: Any) -> set[str]:
    """Class names of the blocks transformers never splits across devices: the decoder layers.

    Relies on ``PreTrainedModel._no_split_modules`` (a class attribute set by each model,
    checked on transformers 5.19); a peft model is looked through to its base model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(getattr(base, "_no_split_modules", None) or [])
