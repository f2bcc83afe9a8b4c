"""The small interface the core knows an inference engine by.

Start from weights, generate a prompt group with a seed, take new weights and report their
fingerprint, shut down: transformers ``generate`` and vLLM are two implementations, a user's
own engine is a third.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from periodic_rl.rollout.types import GenerationRequest, SamplingConfig


def sample_seed(group_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a group seeded ``group_seed`` (fits in 63 bits)."""
    return (group_seed * 1_000_003 + sample_index) % (2**63 - 1)


class InferenceEngine(ABC):
    """Generates completions from a set of weights, and takes new weights in place.

    Implementations: :class:`~periodic_rl.rollout.hf_engine.HFEngine` (transformers ``generate``)
    and :class:`~periodic_rl.rollout.vllm_engine.VLLMEngine` (vLLM). A user's own engine is a
    subclass of this one.
    """

    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        """For each request, ``request.n`` completions as token ids (no padding; the EOS token
        is kept when generation stopped on it). Same requests and seeds give the same output."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor], partial: bool = False) -> str:
        """Replace the engine's weights (transformers parameter names) and return the
        fingerprint of what was loaded, computed where the weights were received. The engine
        copies what it keeps: callers reuse (or free) the tensors afterwards.

        ``partial=True`` (LoRA adapter pushes) replaces only the weights named, which must be
        known to the model and cover every name :meth:`partial_load_names` asks for; the others
        keep their values. An engine written before partial loads (no ``partial`` argument)
        still works: workers then push it full state dicts (see
        :mod:`periodic_rl.weight_sync.merge`)."""

    def partial_load_names(self, names: set[str]) -> set[str]:
        """The names a partial load touching ``names`` must carry: ``names`` themselves, plus
        whatever the engine can only load together with them (vLLM: the other members of a
        fused ``qkv_proj`` or ``gate_up_proj``). Default: ``names``."""
        return set(names)

    @abstractmethod
    def fingerprint(self) -> str:
        """Fingerprint of the weights the engine holds now (see :func:`weights_fingerprint`)."""

    @abstractmethod
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[t] | token_ids[:t])`` for ``t = 1 .. len-1`` under the current
        weights. Used to prove a weight push landed."""

    def shutdown(self) -> None:
        """Release the engine's processes and memory. Safe to call twice."""
        return None
