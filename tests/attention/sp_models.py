"""Tiny decoder models of several families, and random prompt groups, for the attention tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def _root_conftest():  # noqa: ANN202 - a module
    """tests/conftest.py by path: ``import conftest`` may resolve to another directory's."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("_periodic_rl_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_llama_config = _root_conftest().tiny_llama_config

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_config(arch: str, **overrides):  # noqa: ANN201 - a transformers config
    """A small config of family ``arch``; ``overrides`` go to the config class."""
    import transformers as tf

    if arch == "llama":
        return tiny_llama_config(vocab_size=VOCAB, **overrides)
    kwargs = dict(COMMON)
    if arch == "qwen2":  # q/k/v biases, untied head
        cls = tf.Qwen2Config
        kwargs.update(tie_word_embeddings=False)
    elif arch == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        cls = tf.Qwen3Config
        kwargs.update(head_dim=32)
    elif arch == "mistral":  # sliding_window passed to attention (large by default here)
        cls = tf.MistralConfig
        kwargs.update(sliding_window=4096)
    elif arch == "gemma":  # scaled embeddings, head_dim != hidden / heads, MQA
        cls = tf.GemmaConfig
        kwargs.update(head_dim=24, num_key_value_heads=1)
    elif arch == "gemma2":  # query_pre_attn_scalar scaling, sliding layers, final-logit softcap
        cls = tf.Gemma2Config
        kwargs.update(
            head_dim=16, query_pre_attn_scalar=20, sliding_window=4096, attn_logit_softcapping=None
        )
    else:
        raise ValueError(arch)
    kwargs.update(overrides)
    return cls(**kwargs)


def make_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised fp32 causal LM in eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides), dtype=torch.float32)
    return model.eval()


def random_groups(
    seed: int, spec: list[tuple[int, list[int]]]
) -> list[tuple[list[int], list[list[int]]]]:
    """Groups ``[(prompt_len, [completion_len, ...]), ...]`` of random tokens in ``[3, VOCAB)``."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    return [(tokens(p), [tokens(r) for r in rs]) for p, rs in spec]


# unequal prompt lengths, unequal completion lengths, G differs between groups, a length-1 reply
UNEQUAL = [(7, [5, 3, 9]), (4, [6, 1]), (11, [2, 8, 4, 7])]


def weighted_sum(logps: torch.Tensor) -> torch.Tensor:
    """A scalar with distinct weights per token, so that gradients see every position."""
    weights = torch.linspace(0.1, 1.0, logps.numel(), dtype=logps.dtype).view_as(logps)
    return (logps * weights).sum()


def grads_of(model: torch.nn.Module, fn) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Gradients of ``weighted_sum(fn())`` w.r.t. the trainable parameters."""
    model.zero_grad(set_to_none=True)
    logps = fn()
    weighted_sum(logps).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)
