"""Models, a tokenizer and prompt groups for the GPU check, built locally (no download).

The lent GPU machine has no network: every model of ``gpu_check.py`` is built from a
transformers config with random weights, and its tokenizer is a byte-level one made here (256
byte tokens plus pad, BOS and EOS, and a plain chat template), so that ``RLModule`` and the HF
engine load a real model directory.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

#: The families the packing and probe checks cover (the ones ``tests/attention/sp_models.py``
#: builds), each with what it adds to the plain Llama layout.
FAMILIES = {
    "llama": "the reference layout",
    "qwen2": "q/k/v biases, untied head",
    "qwen3": "per-head q/k RMSNorm, explicit head_dim",
    "mistral": "sliding_window passed to attention",
    "gemma": "scaled embeddings, head_dim != hidden / heads, MQA",
    "gemma2": "query_pre_attn_scalar, sliding layers",
}
VOCAB = 259  # 256 bytes + pad, BOS, EOS
PAD, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_tokenizer():  # noqa: ANN201 - a transformers tokenizer
    """A byte-level BPE tokenizer without merges: every UTF-8 byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def family_config(family: str, **overrides):  # noqa: ANN201 - a transformers config
    """A tiny config of ``family`` (hidden 64, 2 layers, 4 query / 2 KV heads)."""
    import transformers as tf

    kwargs: dict = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    classes = {
        "llama": (tf.LlamaConfig, dict(tie_word_embeddings=True)),
        "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=False)),
        "qwen3": (tf.Qwen3Config, dict(head_dim=32)),
        "mistral": (tf.MistralConfig, dict(sliding_window=4096)),
        "gemma": (tf.GemmaConfig, dict(head_dim=24, num_key_value_heads=1)),
        "gemma2": (
            tf.Gemma2Config,
            dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=4096),
        ),
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(classes)}")
    cls, extra = classes[family]
    kwargs.update(extra)
    if family == "gemma2":
        kwargs["attn_logit_softcapping"] = None
    kwargs.update(overrides)
    return cls(**kwargs)


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) attention logits: a wrong mask or position moves the log-probs far
    beyond rounding (the usual 0.02 initialisation would hide it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if p.dim() >= 2:
                scale = 0.5 if "emb" in name else 1.0
                p.copy_(noise / math.sqrt(p[0].numel()) * scale)
            else:
                p.add_(0.1 * noise)


def family_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 causal LM of ``family`` in eval mode, with spread-out weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    spread_weights(model, seed)
    return model.eval()


def qwen2_half_billion(vocab_size: int = 151936, layers: int = 24):  # noqa: ANN201
    """The shape of Qwen2.5-0.5B (hidden 896, 14/2 heads, FFN 4864, tied embeddings): 0.49B
    parameters at its own vocabulary."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def save_training_model(path: Path, hidden: int = 64, seed: int = 0) -> str:
    """A tiny Llama with the byte tokenizer, saved as a model directory for ``RLModule``."""
    from transformers import AutoModelForCausalLM

    config = family_config(
        "llama", hidden_size=hidden, intermediate_size=2 * hidden, max_position_embeddings=512
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def random_groups(
    seed: int, spec: list[tuple[int, list[int]]], vocab: int = VOCAB
) -> list[tuple[list[int], list[list[int]]]]:
    """Groups ``[(prompt_len, [completion_len, ...]), ...]`` of random tokens in ``[3, vocab)``."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return [(tokens(p), [tokens(r) for r in rs]) for p, rs in spec]


#: unequal prompt and completion lengths, G differing between groups, a length-1 reply
UNEQUAL = [(7, [5, 3, 9]), (4, [6, 1]), (11, [2, 8, 4, 7]), (40, [33, 17, 64, 5])]
