"""Shared-prompt attention: encode each GRPO prompt once per group, not once per completion.

A group ``(prompt, [r1, ..., rG])`` becomes one packed sequence ``[prompt | r1 | ... | rG]``;
position ids restart at ``len(prompt)`` for every response and each response attends to the whole
prompt plus its own earlier tokens. Tokens per group fall from ``G(P+R)`` to ``P+GR``.

Public API:

- :func:`completion_logprobs`: per-token log-probs (and optionally entropy) of completions,
  packed (``shared_prompt=True``) or padded (the reference);
- :func:`pack_groups` / :func:`pad_groups`: the two input layouts, :class:`SharedPromptLayout`;
- :data:`BACKENDS`, :func:`register_backend`, :func:`select_backend`,
  :func:`available_backends`: the attention kernels (``sdpa``, ``split``, ``flex``, ``flash``);
- :func:`shared_prompt_attention`: the context that routes a model's attention through the
  shared-prompt dispatcher (needed around backward with gradient checkpointing).
"""

from periodic_rl.attention.backends import (
    BACKENDS,
    AttentionBackend,
    AttentionOptions,
    available_backends,
    register_backend,
    select_backend,
)
from periodic_rl.attention.integration import (
    ATTN_NAME,
    SharedPromptUnsupportedError,
    check_model_supported,
    shared_prompt_attention,
    shared_prompt_attention_forward,
)
from periodic_rl.attention.layout import SharedPromptLayout
from periodic_rl.attention.logprobs import completion_logprobs, token_logprobs
from periodic_rl.attention.packing import ModelBatch, pack_groups, pad_groups

__all__ = [
    "ATTN_NAME",
    "BACKENDS",
    "AttentionBackend",
    "AttentionOptions",
    "ModelBatch",
    "SharedPromptLayout",
    "SharedPromptUnsupportedError",
    "available_backends",
    "check_model_supported",
    "completion_logprobs",
    "pack_groups",
    "pad_groups",
    "register_backend",
    "select_backend",
    "shared_prompt_attention",
    "shared_prompt_attention_forward",
    "token_logprobs",
]
