"""HFEngine: seeded reproducibility, batch independence, EOS handling, weight pushes."""

from __future__ import annotations

import pytest
import torch

from periodic_rl.rollout.types import GenerationRequest, SamplingConfig
from periodic_rl.weight_sync.fingerprint import weights_fingerprint

SAMPLING = SamplingConfig(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def hf_tiny(vllm_tiny_path):
    from periodic_rl.rollout.engines.hf_engine import HFEngine

    return HFEngine(vllm_tiny_path)


def _requests(seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=[1, 504, 3016, 28], n=3, seed=seed),
        GenerationRequest(prompt_ids=[1, 2000, 30, 40, 50, 60, 70], n=2, seed=seed + 1),
        GenerationRequest(prompt_ids=[1, 9], n=4, seed=seed + 2),
    ]


def test_same_seeds_same_completions_different_seeds_differ(hf_tiny):
    first = hf_tiny.generate(_requests(), SAMPLING)
    assert first == hf_tiny.generate(_requests(), SAMPLING)
    assert [len(group) for group in first] == [3, 2, 4]
    assert all(len(c) == SAMPLING.max_new_tokens for group in first for c in group)
    other = hf_tiny.generate(_requests(seed=100), SAMPLING)
    assert all(a != b for a, b in zip(first, other, strict=True))
    # The samples of one group differ from each other (each has its own seed).
    assert len({tuple(c) for c in first[0]}) == 3


def test_group_does_not_depend_on_the_other_groups(hf_tiny):
    together = hf_tiny.generate(_requests(), SAMPLING)
    alone = [hf_tiny.generate([request], SAMPLING)[0] for request in _requests()]
    assert together == alone
    reversed_order = hf_tiny.generate(_requests()[::-1], SAMPLING)[::-1]
    assert together == reversed_order


def test_global_rng_does_not_matter(hf_tiny):
    torch.manual_seed(123)
    first = hf_tiny.generate(_requests(), SAMPLING)
    torch.manual_seed(456)
    assert first == hf_tiny.generate(_requests(), SAMPLING)


def test_greedy_and_tiny_top_p_agree(hf_tiny):
    greedy = hf_tiny.generate(_requests(), SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert all(len({tuple(c) for c in group}) == 1 for group in greedy)
    nucleus = hf_tiny.generate(
        _requests(seed=7), SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=1e-6)
    )
    assert nucleus == greedy


def test_weight_push_lands(hf_tiny, vllm_tiny_path, fixed_ids, make_trainer, ref_logprobs):
    before = torch.tensor(hf_tiny.prompt_logprobs(fixed_ids))
    assert len(before) == len(fixed_ids) - 1
    trainer = make_trainer(vllm_tiny_path, scale=0.02, seed=1)
    state_dict = trainer.state_dict()
    fingerprint = hf_tiny.load_weights(state_dict)
    assert fingerprint == weights_fingerprint(state_dict) == hf_tiny.fingerprint()
    after = torch.tensor(hf_tiny.prompt_logprobs(fixed_ids))
    expected = ref_logprobs(trainer, fixed_ids)
    assert (after - expected).abs().max().item() < 1e-5
    assert (after - before).abs().max().item() > 1e-2


def test_tied_lm_head_may_be_absent_and_names_are_strict(hf_tiny, vllm_tiny_path, make_trainer):
    trainer = make_trainer(vllm_tiny_path, scale=0.01, seed=2)
    state_dict = {k: v for k, v in trainer.state_dict().items() if k != "lm_head.weight"}
    assert hf_tiny.load_weights(state_dict) == weights_fingerprint(state_dict)
    assert torch.equal(hf_tiny.model.lm_head.weight, trainer.lm_head.weight)
    with pytest.raises(KeyError, match="unexpected"):
        hf_tiny.load_weights({**state_dict, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_tiny.load_weights({k: v for k, v in state_dict.items() if k != "model.norm.weight"})


def test_lora_adapter_pushes_land(hf_tiny, vllm_tiny_path, fixed_ids, ref_logprobs):
    """The base once, then only adapters: after each LoRA training step the engine's log-probs
    are the trainer's, and its weights are ``policy_state_dict``'s bit for bit."""
    from lora_helpers import peft_policy, sgd_step

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
        policy_state_dict,
    )
    from periodic_rl.weight_sync.fingerprint import adapter_fingerprint
    from periodic_rl.weight_sync.merge import AdapterLoader

    policy = peft_policy(vllm_tiny_path)
    names = adapted_names(lora_adapter_payload(policy))
    loader = AdapterLoader()
    base = lora_base_state_dict(policy)
    base_fingerprint = hf_tiny.load_weights(base)
    loader.keep_base(hf_tiny, base, names, base_fingerprint)
    assert sorted(loader.base) == names  # transformers loads any subset: nothing else is kept
    before = torch.tensor(hf_tiny.prompt_logprobs(fixed_ids))
    for _ in range(2):  # each adapter is merged into the kept base, not into the last merge
        sgd_step(policy, fixed_ids)
        payload = lora_adapter_payload(policy)
        assert loader.load(hf_tiny, payload) == adapter_fingerprint(base_fingerprint, payload)
        after = torch.tensor(hf_tiny.prompt_logprobs(fixed_ids))
        diff = (after - ref_logprobs(policy, fixed_ids)).abs().max().item()
        assert diff < 1e-5, diff
        own = hf_tiny.model.state_dict()
        assert all(torch.equal(own[k], v) for k, v in policy_state_dict(policy).items())
    assert (after - before).abs().max().item() > 1e-2
    with pytest.raises(KeyError, match="unexpected|does not have"):
        hf_tiny.load_weights({"model.extra.weight": torch.zeros(1)}, partial=True)


@pytest.mark.pretrained
def test_pretrained_completion_keeps_eos_and_push_matches_trainer(
    smollm2_path, smollm2_trained, ref_logprobs, fixed_ids
):
    from transformers import AutoTokenizer

    from periodic_rl.rollout.engines.hf_engine import HFEngine

    engine = HFEngine(smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    request = GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], n=1, seed=0)
    (group,) = engine.generate([request], SamplingConfig(max_new_tokens=40, temperature=0.0))
    (completion,) = group  # greedy SmolLM2 answers this in 30 tokens, then <|im_end|>
    assert completion[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in completion[:-1]

    before = torch.tensor(engine.prompt_logprobs(fixed_ids))
    state_dict = smollm2_trained.state_dict()
    assert engine.load_weights(state_dict) == weights_fingerprint(state_dict)
    after = torch.tensor(engine.prompt_logprobs(fixed_ids))
    diff = (after - ref_logprobs(smollm2_trained, fixed_ids)).abs().max().item()
    assert diff < 1e-4, diff
    assert (after - before).abs().max().item() > 1e-2
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.prompt_logprobs(fixed_ids)
