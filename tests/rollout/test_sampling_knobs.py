"""The sampling knobs ``top_k``, ``min_p`` and ``repetition_penalty``: SamplingConfig's checks,
and both engines applying them the same way, with behaviour log-probs of the processed
distribution (the one the tokens were drawn from).

The engines run a "sharp" copy of the vLLM-compatible tiny model: its final norm scaled by
:data:`SHARPEN`, so that its logits are not nearly flat (the random model puts ~0.4 of the
probability on repeating the last token at T = 0.7) and every knob visibly changes what is drawn.
Allowed token sets and reference log-probs come from a plain transformers forward.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from periodic_rl.attention import completion_logprobs
from periodic_rl.config_checks import check_sampling
from periodic_rl.models import load_causal_lm
from periodic_rl.rollout.engines.hf_engine import (
    HFEngine,
    processed_logits,
    repetition_penalty_filter,
)
from periodic_rl.rollout.types import GenerationRequest, SamplingConfig

T = 0.7
SHARPEN = 8.0
HF_ATOL = 1e-5
VLLM_ATOL = 1e-4  # as in test_behaviour_logprobs.py: vLLM's CPU kernels against a plain forward


def _requests(seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=[1, 504, 3016, 28], n=4, seed=seed),
        GenerationRequest(prompt_ids=[1, 2000, 30, 40, 50], n=4, seed=seed + 1),
    ]


@pytest.fixture(scope="module")
def sharp_path(tmp_path_factory, vllm_tiny_path) -> str:
    from transformers import AutoTokenizer

    model = load_causal_lm(vllm_tiny_path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    path = tmp_path_factory.mktemp("tiny-sharp")
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(vllm_tiny_path).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(sharp_path):
    return load_causal_lm(sharp_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(sharp_path):
    engine = HFEngine(sharp_path)
    yield engine
    engine.shutdown()


def _raw_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The raw next-token logits (fp32) at each completion position, one row per token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()


def _reference(model, prompt, completion, sampling) -> torch.Tensor:
    """Each completion token's log-prob under the processed distribution, from a plain forward
    and :func:`processed_logits` (repetition penalty over the prompt and the tokens so far)."""
    logits = _raw_logits(model, prompt, completion)
    ids = prompt + completion
    rows = [
        processed_logits(logits[t : t + 1], torch.tensor([ids[: len(prompt) + t]]), sampling)
        for t in range(len(completion))
    ]
    logps = torch.cat(rows).log_softmax(-1)
    return logps.gather(1, torch.tensor(completion)[:, None])[:, 0]


def _max_gap(model, requests, outputs, sampling) -> float:
    gaps = []
    for request, (completions, rows) in zip(requests, outputs, strict=True):
        for completion, row in zip(completions, rows, strict=True):
            expected = _reference(model, request.prompt_ids, completion, sampling)
            gaps.append((expected - torch.tensor(row)).abs().max().item())
    return max(gaps)


# ---- SamplingConfig -------------------------------------------------------------------------


def test_defaults_are_off():
    sampling = SamplingConfig(max_new_tokens=4)
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (0, 0.0, 1.0)
    SamplingConfig(4, temperature=0.0, top_p=1.0, top_k=1, min_p=0.5, repetition_penalty=0.5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": 2.0}, r"max_new_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0 \(0: greedy\)"),
        ({"temperature": math.nan}, r"temperature must be"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1: off\), got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k must be an integer >= 0 \(0: off; not -1"),
        ({"top_k": 2.5}, r"top_k must be an integer >= 0"),
        ({"top_k": True}, r"top_k must be an integer >= 0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\) \(0: off\), got 1.0"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\)"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0 \(1: off"),
        ({"repetition_penalty": math.inf}, r"repetition_penalty must be a finite number > 0"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**{"max_new_tokens": 4, **fields})


def test_module_config_check_refuses_bad_knobs_and_tolerates_absent_ones():
    base = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
    check_sampling(base)  # a module that does not pass the knobs yet: their "off" values
    check_sampling({**base, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    for field, value in [("top_k", -1), ("min_p", 1.0), ("repetition_penalty", 0.0)]:
        with pytest.raises(ValueError, match=field):
            check_sampling({**base, field: value})


# ---- the HF engine --------------------------------------------------------------------------


def test_greedy_is_the_argmax_of_the_raw_logits_and_top_k_1_equals_it(hf, model):
    """The evaluation path (temperature 0, knobs off) is a plain argmax; ``top_k=1`` sampling
    gives the same tokens whatever the seeds, each drawn with probability 1."""
    greedy = hf.generate(_requests(), SamplingConfig(max_new_tokens=8, temperature=0.0))
    for request, group in zip(_requests(), greedy, strict=True):
        ids = list(request.prompt_ids)
        for _ in range(8):
            with torch.no_grad():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert group == [ids[len(request.prompt_ids) :]] * request.n
    top1 = SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=1)
    outputs = hf.generate_with_logprobs(_requests(seed=9), top1)
    assert [c for c, _ in outputs] == greedy
    assert {v for _, rows in outputs for row in rows for v in row} == {0.0}


def test_repetition_penalty_changes_greedy_and_top_k_1_follows(hf, model):
    plain = hf.generate(_requests(), SamplingConfig(max_new_tokens=8, temperature=0.0))
    greedy_rp = SamplingConfig(max_new_tokens=8, temperature=0.0, repetition_penalty=1.5)
    penalised = hf.generate(_requests(), greedy_rp)
    assert penalised != plain  # the random model repeats its last token; the penalty stops it
    for request, group in zip(_requests(), penalised, strict=True):
        ids = list(request.prompt_ids)
        for _ in range(8):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
            ids.append(int(repetition_penalty_filter(logits, torch.tensor([ids]), 1.5).argmax()))
        assert group[0] == ids[len(request.prompt_ids) :]
    top1 = dataclasses.replace(greedy_rp, temperature=1.0, top_k=1)
    assert hf.generate(_requests(seed=3), top1) == penalised
    # Sampling: the same seeds draw other tokens once repeats are penalised.
    sampled = SamplingConfig(max_new_tokens=8, temperature=T)
    assert hf.generate(_requests(), sampled) != hf.generate(
        _requests(), dataclasses.replace(sampled, repetition_penalty=1.5)
    )


def _allowed(logits: torch.Tensor, top_k: int = 0, min_p: float = 0.0) -> set[int]:
    """The tokens ``top_k`` / ``min_p`` allow, straight from one position's raw logits."""
    if top_k:
        return set(logits.topk(top_k).indices.tolist())
    probs = (logits / T).softmax(-1)
    return set(torch.nonzero(probs >= min_p * probs.max())[:, 0].tolist())


@pytest.mark.parametrize("knob", [{"top_k": 4}, {"min_p": 0.05}])
def test_sampled_tokens_stay_in_the_allowed_set(hf, model, knob):
    sampling = SamplingConfig(max_new_tokens=8, temperature=T, **knob)
    unrestricted = SamplingConfig(max_new_tokens=8, temperature=T)
    inside = {"knob": 0, "off": 0}
    tokens = 0
    for name, config in [("knob", sampling), ("off", unrestricted)]:
        for request, group in zip(_requests(), hf.generate(_requests(), config), strict=True):
            for completion in group:
                logits = _raw_logits(model, request.prompt_ids, completion)
                for t, token in enumerate(completion):
                    allowed = _allowed(logits[t], **knob)
                    inside[name] += token in allowed
                    tokens += name == "knob"
                    if name == "knob":
                        assert token in allowed, (completion, t, sorted(allowed))
    assert inside["knob"] == tokens
    assert inside["off"] < tokens  # without the knob, tokens outside the set are drawn
    # Still sampling: the first tokens of a group are not all the same.
    first = [c[0] for group in hf.generate(_requests(seed=4), sampling) for c in group]
    assert len(set(first)) > 1


KNOBS = [
    {"top_k": 4},
    {"min_p": 0.05},
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.8},
    {"top_k": 50, "min_p": 0.02, "top_p": 0.9, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("knobs", KNOBS)
def test_behaviour_logprobs_are_those_of_the_processed_distribution(hf, model, knobs):
    """Each reported log-prob is ``log_softmax`` of the processed logits at that step, not the
    trainer's ``softmax(logits / T)``: the knobs show up as engine/trainer mismatch."""
    sampling = SamplingConfig(max_new_tokens=8, temperature=T, **knobs)
    outputs = hf.generate_with_logprobs(_requests(), sampling)
    assert [c for c, _ in outputs] == hf.generate(_requests(), sampling)
    assert _max_gap(model, _requests(), outputs, sampling) < HF_ATOL
    # The knob counts: the reference without it is another distribution, and so is the
    # trainer's softmax(logits / T).
    if len(knobs) == 1:
        (field,) = knobs
        off = dataclasses.replace(sampling, **{field: getattr(SamplingConfig(1), field)})
        assert _max_gap(model, _requests(), outputs, off) > 1e-2
    groups = [(r.prompt_ids, c) for r, (c, _) in zip(_requests(), outputs, strict=True)]
    with torch.no_grad():
        logps, _ = completion_logprobs(model, groups, shared_prompt=False, temperature=T)
    rows = [row for _, group in outputs for row in group]
    trainer_gap = max(
        (logps[i, : len(row)] - torch.tensor(row)).abs().max().item() for i, row in enumerate(rows)
    )
    assert trainer_gap > 1e-2


def test_generation_config_json_cannot_reshape_the_distribution(sharp_path, hf):
    """A model whose generation_config asks for sampling with top_k, top_p, min_p, temperature
    and a repetition penalty samples exactly as one without: ``generate`` runs greedy over this
    engine's own processors, with the penalty pinned to 1."""
    engine = HFEngine(sharp_path)
    try:
        config = engine.model.generation_config
        config.do_sample, config.top_k, config.top_p = True, 1, 0.1
        config.min_p, config.temperature, config.repetition_penalty = 0.9, 0.1, 3.0
        for sampling in [
            SamplingConfig(max_new_tokens=6, temperature=T),
            SamplingConfig(max_new_tokens=6, temperature=0.0),
            SamplingConfig(max_new_tokens=6, temperature=T, top_k=4, repetition_penalty=1.2),
        ]:
            expected = hf.generate_with_logprobs(_requests(), sampling)
            assert engine.generate_with_logprobs(_requests(), sampling) == expected
    finally:
        engine.shutdown()


# ---- vLLM -----------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_applies_the_knobs_as_the_hf_engine(vllm_tiny, vllm_tiny_path, sharp_path, model, hf):
    """vLLM with the sharp weights: greedy with a repetition penalty gives the HF engine's
    tokens, ``top_k=1`` gives greedy's, and the behaviour log-probs under all knobs are those of
    :func:`processed_logits` (vLLM's processed log-probs, not its raw ones)."""
    original = load_causal_lm(vllm_tiny_path, dtype=torch.float32).state_dict()
    vllm_tiny.load_weights(model.state_dict())
    try:
        greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, repetition_penalty=1.5)
        penalised = vllm_tiny.generate(_requests(), greedy)
        assert penalised == hf.generate(_requests(), greedy)
        top1 = dataclasses.replace(greedy, temperature=1.0, top_k=1)
        assert vllm_tiny.generate(_requests(seed=3), top1) == penalised
        sampling = SamplingConfig(max_new_tokens=8, temperature=T, **KNOBS[-1])
        outputs = vllm_tiny.generate_with_logprobs(_requests(), sampling)
        gap = _max_gap(model, _requests(), outputs, sampling)
        print(f"max |vLLM - processed reference| log-prob: {gap:.2e}")
        assert gap < VLLM_ATOL, f"max |vLLM - processed reference| = {gap:.2e}"
        plain = SamplingConfig(max_new_tokens=8, temperature=T)
        assert _max_gap(model, _requests(), outputs, plain) > 1e-2
    finally:
        vllm_tiny.load_weights(original)
