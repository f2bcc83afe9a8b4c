"""Training log-probs are those of the distribution the rollouts were sampled from.

Rollouts are drawn from ``softmax(logits / T)``; the ratio, the KL and the policy gradient must
use the same distribution. Each test compares the trainer's log-probs of sampled tokens with the
log-probs the HF engine recorded while sampling them (same weights), at T = 0.7.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import train

import periodic_rl.micro_batch as module_mod
from periodic_rl.attention import completion_logprobs
from periodic_rl.models import load_causal_lm
from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.rollout.types import GenerationRequest, SamplingConfig
from periodic_rl.weight_sync.export import policy_state_dict

T = 0.7
ATOL = 1e-5
PROMPTS = [[1, 520, 3411, 30, 418], [1, 77, 9120, 4, 4, 318, 12]]


def _sample(engine: HFEngine, prompts: list[list[int]], seeds: list[int], tokens: int = 12):
    sampling = SamplingConfig(max_new_tokens=tokens, temperature=T)
    requests = [
        GenerationRequest(prompt_ids=p, n=4, seed=s) for p, s in zip(prompts, seeds, strict=True)
    ]
    return engine.generate_with_logprobs(requests, sampling)


def _max_gap(logps: torch.Tensor, mask: torch.Tensor, engine_logps: list[list[float]]) -> float:
    gap = 0.0
    for row, expected in enumerate(engine_logps):
        assert mask[row].sum().item() == len(expected)
        got = logps[row, : len(expected)]
        gap = max(gap, (got - torch.tensor(expected)).abs().max().item())
    return gap


def _check_against_engine(model: torch.nn.Module, engine: HFEngine) -> None:
    outputs = _sample(engine, PROMPTS, seeds=[11, 12])
    groups = [(p, completions) for p, (completions, _) in zip(PROMPTS, outputs, strict=True)]
    engine_logps = [row for _, rows in outputs for row in rows]
    assert all(len(row) > 0 for row in engine_logps)
    with torch.no_grad():
        for shared_prompt in (True, False):
            logps, mask = completion_logprobs(
                model, groups, shared_prompt=shared_prompt, temperature=T
            )
            gap = _max_gap(logps, mask, engine_logps)
            assert gap < ATOL, f"shared_prompt={shared_prompt}: max |trainer - engine| {gap:.2e}"
        untempered, mask = completion_logprobs(model, groups)
    # The check can tell the two distributions apart.
    assert _max_gap(untempered, mask, engine_logps) > 1e-2


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    engine = HFEngine(tiny_llama_path)
    yield engine
    engine.shutdown()


def test_trainer_logprobs_equal_engine_sampling_logprobs(engine, tiny_llama_path):
    model = load_causal_lm(tiny_llama_path, dtype=torch.float32).eval()
    engine.load_weights(policy_state_dict(model))
    _check_against_engine(model, engine)


def test_lora_logprobs_equal_engine_sampling_logprobs(engine, tiny_llama_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    base = load_causal_lm(tiny_llama_path, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    policy = get_peft_model(base, LoraConfig(**{**config.to_dict(), "init_lora_weights": False}))
    policy.eval()
    engine.load_weights(policy_state_dict(policy))  # what a push sends: LoRA merged
    _check_against_engine(policy, engine)


def test_rl_module_trains_on_the_sampling_distribution(tiny_llama_path, monkeypatch):
    """Through the module: the log-probs of its first policy forward (weights of iteration 0)
    equal the engine's sampling log-probs of the same groups."""
    recorded = []
    original = module_mod.completion_logprobs

    def spy(model, groups, **kwargs):
        out = original(model, groups, **kwargs)
        if torch.is_grad_enabled():  # the policy forward, not the reference
            recorded.append((groups, out[0].detach().clone(), out[1]))
        return out

    monkeypatch.setattr(module_mod, "completion_logprobs", spy)
    batch_size = 2
    _, module, _ = train(
        tiny_llama_path, steps=1, batch_size=batch_size, temperature=T, max_new_tokens=8
    )
    assert len(recorded) == batch_size  # one group per micro-batch

    engine = HFEngine(tiny_llama_path)  # the weights the first iteration sampled with
    try:
        seeds = [module.group_seed(0, i) for i in range(batch_size)]
        for groups, logps, mask in recorded:
            ((prompt, completions),) = groups
            candidates = _sample(engine, [prompt] * batch_size, seeds, tokens=8)
            matches = [rows for comps, rows in candidates if comps == completions]
            assert matches, "the engine did not reproduce the trained group"
            gap = _max_gap(logps, mask, matches[0])
            assert gap < ATOL, f"max |trainer - engine| {gap:.2e}: not the sampling distribution"
    finally:
        engine.shutdown()
