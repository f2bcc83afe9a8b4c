"""The small interface the core knows an inference engine by.

Start from weights, generate a prompt group with a seed, take new weights and report their
fingerprint, shut down: transformers ``generate`` and vLLM are two implementations, a user's
own engine is a third.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from periodic_rl.rollout.types import GenerationRequest, SamplingConfig, behaviour_logprobs


def sample_seed(group_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a group seeded ``group_seed`` (fits in 63 bits)."""
    return (group_seed * 1_000_003 + sample_index) % (2**63 - 1)


class InferenceEngine(ABC):
    """Generates completions from a set of weights, and takes new weights in place.

    Implementations: :class:`~periodic_rl.rollout.engines.hf_engine.HFEngine` (transformers
    ``generate``) and :class:`~periodic_rl.rollout.engines.vllm_engine.VLLMEngine` (vLLM). A
    user's own engine is a subclass of this one: :meth:`generate`, :meth:`load_weights`,
    :meth:`fingerprint` and :meth:`prompt_logprobs` are required;
    :meth:`generate_with_logprobs` (behaviour log-probs, for the mismatch metrics and truncated
    importance sampling) is optional.
    """

    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[list[int]]]:
        """For each request, ``request.n`` completions as token ids (no padding; the EOS token
        is kept when generation stopped on it). Same requests and seeds give the same output."""

    def generate_with_logprobs(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """What the rollout workers call: for each request, ``(completions, logprobs)``, the
        completions of :meth:`generate` and their *behaviour* log-probs, one list per completion
        holding, for each token, its log-prob under the distribution it was sampled from
        (the softmax of the logits after ``repetition_penalty``, ``/ temperature``, ``min_p``,
        ``top_k`` and ``top_p``: :class:`~periodic_rl.rollout.types.SamplingConfig`), as
        floats.

        ``logprobs`` may be ``[]`` (the engine cannot tell; at ``temperature == 0`` nothing is
        sampled and both built-in engines return ``[]``). This default calls :meth:`generate`
        and returns ``[]`` for every request, so an engine that implements only
        :meth:`generate` keeps working: its groups carry no behaviour log-probs, the
        ``mismatch/*`` metrics are not logged, and ``RLModule(tis_cap=...)`` is refused at the
        first iteration. Override this method to provide them; they must be those of the tokens
        :meth:`generate` returns. A subclass that overrides :meth:`generate` but not this
        method (of a built-in engine, say) is generated through its :meth:`generate`, without
        log-probs (:func:`generate_groups`): its parent's log-probs might not be those of the
        tokens its own :meth:`generate` returns.
        """
        return [(group, []) for group in self.generate(requests, sampling)]

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


def generate_groups(
    engine: InferenceEngine, requests: list[GenerationRequest], sampling: SamplingConfig
) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Each request's completions (``int`` token ids) and behaviour log-probs, checked with
    :func:`~periodic_rl.rollout.types.behaviour_logprobs` (``[]`` when the engine gave none): what
    the rollout workers and the in-process rollouts call.

    ``engine.generate_with_logprobs``, unless the engine's class overrides ``generate`` below the
    class that defines ``generate_with_logprobs``: then ``engine.generate``, without log-probs.
    """
    if _overrides_generate_only(type(engine)):
        outputs = [(group, []) for group in engine.generate(requests, sampling)]
    else:
        outputs = engine.generate_with_logprobs(requests, sampling)
    if len(outputs) != len(requests):
        raise RuntimeError(f"engine returned {len(outputs)} groups for {len(requests)} requests")
    groups = []
    for completions, logprobs in outputs:
        ids = [[int(token) for token in completion] for completion in completions]
        groups.append((ids, behaviour_logprobs(ids, logprobs)))
    return groups


def _overrides_generate_only(cls: type) -> bool:
    """Whether ``cls.generate`` is defined in a strict subclass of the class that defines
    ``cls.generate_with_logprobs``."""

    def owner(name: str) -> type:
        return next(klass for klass in cls.__mro__ if name in vars(klass))

    generate, with_logprobs = owner("generate"), owner("generate_with_logprobs")
    return generate is not with_logprobs and issubclass(generate, with_logprobs)
