"""A tiny, randomly initialised model of ANY causal-LM family in transformers' auto mapping.

``tiny_config(model_type)`` instantiates the family's config class with its defaults, then
shrinks every size attribute it knows by name (width, depth, heads, FFN, experts, vocab,
positions, MLA ranks, vision/audio towers in sub-configs), recursively through sub-configs. Only
the attributes the default config actually has are passed, so derived defaults (``head_dim``,
``layer_types``) are recomputed by the config class from the smaller sizes. A few families need
an extra override (``FAMILY_OVERRIDES``), each with its reason.

``build_tiny_model(model_type)`` then builds the model in fp32 and eval mode (no dropout) and
re-draws its weights with a larger spread than the usual ``initializer_range = 0.02``, so that
attention is far from uniform: a mistake in positions or masking then moves the log-probs by
much more than the 1e-5 the family test allows (tiny weights would hide it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

WIDTH = 64
VOCAB = 256

_WIDTH_KEYS = {
    "hidden_size", "n_embd", "d_model", "emb_dim", "word_embed_proj_dim", "embedding_size",
    "attention_hidden_size", "lru_width", "backbone_hidden_size", "hidden_size_global",
    "input_embedding_size", "output_embedding_size", "embed_dim", "dim", "hidden_dim",
    "projection_dim", "projector_input_dim", "projector_output_dim", "out_hidden_size",
    "vision_output_dim", "text_hidden_size", "embedding_dim", "hidden_size_per_layer_input",
}  # fmt: skip
_LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers", "depth", "conf_num_hidden_layers",
}  # fmt: skip
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
    "encoder_attention_heads", "attention_heads", "num_encoder_attention_heads",
    "num_decoder_attention_heads", "swa_num_attention_heads", "linear_num_value_heads",
    "linear_num_heads",
}  # fmt: skip
_KV_HEAD_KEYS = {
    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
    "num_query_groups", "swa_num_key_value_heads", "linear_num_key_heads",
}  # fmt: skip
_HEAD_DIM_KEYS = {
    "head_dim", "kv_channels", "attention_head_dim", "d_head", "dim_head", "attention_head_size",
    "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim",
    "v_head_dim", "index_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim",
}  # fmt: skip
_FFN_KEYS = {
    "intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff", "dff", "dim_ff",
    "ffn_hidden_size", "intermediate_size_mlp", "feed_forward_size", "mlp_dim",
    "dense_intermediate_size", "d_inner", "n_inner",
}  # fmt: skip
_MOE_FFN_KEYS = {
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "shared_intermediate_size",
}  # fmt: skip
_EXPERT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token"}
_ONE_KEYS = {"n_group", "topk_group", "num_expert_group", "first_k_dense_replace"}
_VOCAB_KEYS = {
    "vocab_size", "n_words", "vocab_size_per_layer_input", "audio_vocab_size",
    "decoder_vocab_size", "encoder_hash_byte_group_vocab",
}  # fmt: skip
_POSITION_KEYS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
    "context_length", "model_max_length", "max_source_positions",
}  # fmt: skip
_SPECIAL_TOKENS = {
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 2,
    "cls_token_id": 1, "decoder_start_token_id": 1, "unk_token_id": 0, "mask_token_id": 3,
    "pad_index": 0, "bos_index": 1, "eos_index": 2, "unk_index": 0, "mask_index": 3,
}  # fmt: skip
_SMALL: dict[str, int] = {
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "index_n_heads": 2,
    "image_size": 32, "patch_size": 8, "num_channels": 3, "mamba_d_state": 16, "state_size": 16,
    "ssm_state_size": 16, "mamba_n_heads": 4, "mamba_chunk_size": 16, "chunk_size": 16,
    "time_step_rank": 8, "mamba_dt_rank": 8, "mamba_d_ssm": 64, "o_lora_rank": 16,
    "num_kv_shared_layers": 0, "laurel_rank": 8, "mm_tokens_per_image": 4,
    "num_mel_bins": 16, "hc_lowrank": 8, "ple_embed_dim": 16, "codebook_size": 64,
    "num_centroids": 4, "centroid_intermediate_top_k": 2, "router_hidden_size": 32,
    "rotary_dim": 8, "rotary_emb_base": 10000,
}  # fmt: skip


def _value(key: str, default: Any) -> Any:  # noqa: PLR0911 - a lookup table
    """The tiny value of attribute ``key`` (``default`` is the family's default), or ``default``."""
    if isinstance(default, bool) or default is None:
        return default
    if key in _SPECIAL_TOKENS:
        if isinstance(default, int) and default >= VOCAB:
            return _SPECIAL_TOKENS[key]
        if isinstance(default, list):
            return [t if t < VOCAB else _SPECIAL_TOKENS[key] for t in default]
        return default
    if not isinstance(default, int):
        return default
    if key in _WIDTH_KEYS:
        return WIDTH
    if key in _LAYER_KEYS:
        return min(default, 2)
    if key in _HEAD_KEYS:
        return min(default, 4)
    if key in _KV_HEAD_KEYS:
        return min(default, 2)
    if key in _HEAD_DIM_KEYS:
        return min(default, 16)
    if key in _FFN_KEYS:
        return min(default, 2 * WIDTH)
    if key in _MOE_FFN_KEYS:
        return min(default, 32)
    if key in _EXPERT_KEYS:
        return min(default, 4)
    if key in _TOPK_KEYS:
        return min(default, 2)
    if key in _ONE_KEYS:
        return min(default, 1)
    if key in _VOCAB_KEYS:
        return min(default, VOCAB)
    if key in _POSITION_KEYS:
        return 512
    if key in _SMALL:
        return min(default, _SMALL[key])
    return default


# Steps after building, e.g. a default that cannot be set in the config.
FAMILY_SETUP: dict[str, Any] = {
    "xmod": lambda model: model.set_default_language("en_XX"),  # the adapters are per language
}

# Extra overrides a family needs to build small (or to exercise what it is about), with reasons.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # 24 entries by default, one per layer; must match num_layers
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # the Mamba heads must tile mamba_expand * hidden_size
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # no default for these (None), the model needs them
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # the default config has no convolution layer at all (then it is a plain transformer)
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # layers 3-4 reuse the keys/values of layers 1-2 (KV sharing: 15 of 35 layers by default)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # DbrxAttentionConfig has no rope_theta field but the attention reads it
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # attention every 2nd layer (the default period 8 leaves 2 layers without any)
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    # the LM head needs is_decoder
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    # defaults left at None that the model multiplies / indexes with
    "deepseek_v2": {"num_experts_per_tok": 2, "n_routed_experts": 4},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1,
                  "indexer_head_dim": 16, "indexer_budget": 64, "indexer_compress_ratio": 4}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 64, "indexer_compress_ratio": 4},
    # one Mamba layer and one attention layer (the defaults give only Mamba at 2 layers)
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16,
                         "layer_types": ["linear_attention", "full_attention"]},
    "zamba2": {"attention_hidden_size": 128, "mamba_headdim": 16, "adapter_rank": 8},
}  # fmt: skip

_LAYER_LIST_KEYS = ("layer_types", "layers_block_type")


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (a key of ``CONFIG_MAPPING``); ``overrides`` win."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = _shrunk_kwargs(cls())
    for extra in (FAMILY_OVERRIDES.get(model_type, {}), overrides):
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(kwargs.get(key), dict):
                kwargs[key] = {**kwargs[key], **value}  # a sub-config: merge
            else:
                kwargs[key] = value
    return cls(**kwargs)


def _tiny_layer_list(types: list[Any]) -> list[Any]:
    """One layer of each kind, in order of first appearance (at least two layers)."""
    kinds = list(dict.fromkeys(types))
    return kinds * 2 if len(kinds) == 1 else kinds


def _is_mha(values: dict[str, Any], kv_heads: Any) -> bool:
    heads = [values[k] for k in _HEAD_KEYS & values.keys() if isinstance(values[k], int)]
    return bool(heads) and kv_heads == max(heads)


def _shrunk_kwargs(config: Any) -> dict[str, Any]:
    """The attributes of ``config`` that change, as constructor kwargs (sub-configs as dicts)."""
    subs = set(getattr(type(config), "sub_configs", {}) or {})
    kwargs: dict[str, Any] = {}
    values = config.to_dict()
    for key, default in values.items():
        if key in subs or isinstance(default, dict):
            sub = config.__dict__.get(key)
            if sub is not None and hasattr(sub, "to_dict"):
                kwargs[key] = _shrunk_kwargs(sub)
            continue
        if key in _LAYER_LIST_KEYS and isinstance(default, list) and default:
            kwargs[key] = _tiny_layer_list(default)
            continue
        if key == "head_dim" and default is None:
            value = 16
        elif key in _KV_HEAD_KEYS and default is None:
            value = 2
        elif key in _KV_HEAD_KEYS and _is_mha(values, default):
            value = 4  # as many KV heads as query heads stays so (MLA needs it)
        else:
            value = _value(key, default)
        if value is not default:
            kwargs[key] = value
    if "is_decoder" in values and not values.get("is_encoder_decoder"):
        kwargs["is_decoder"] = True  # BERT-style LM heads are causal only as decoders
    layers = next((kwargs[k] for k in _LAYER_LIST_KEYS if k in kwargs), None)
    if layers is not None:
        for key in _LAYER_KEYS & values.keys():
            kwargs[key] = len(layers)
    if "qk_nope_head_dim" in values and "qk_rope_head_dim" in values:
        kwargs["qk_nope_head_dim"] = 8
        rope = kwargs.get("qk_rope_head_dim", values["qk_rope_head_dim"])
        if "qk_head_dim" in values:
            kwargs["qk_head_dim"] = 8 + rope
        if "head_dim" in values:  # MLA: head_dim is the rotary part (what RoPE is built with)
            kwargs["head_dim"] = rope
    return kwargs


def _redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) attention logits: a wrong mask or position shows in the log-probs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(noise / math.sqrt(fan_in) * (1.0 if "emb" not in name else 0.5))
            else:
                p.add_(0.1 * noise)


def build_tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny fp32 causal LM of ``model_type`` (auto mapping), eval mode, spread-out weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    if model_type in FAMILY_SETUP:
        FAMILY_SETUP[model_type](model)
    return model.eval()
