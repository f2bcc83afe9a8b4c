"""Engine/trainer mismatch through RLModule: ``mismatch/*`` metrics and truncated importance
sampling (``tis_cap``), on one iteration of the in-process HF engine at T = 0.7.

The HF engine samples with the trainer's numerics, so its behaviour log-probs equal the
trainer's (tests/test_temperature.py): the mismatch is ~0. A subclass shifts the behaviour
log-probs by ``SHIFT`` before the backward, which makes every token's mismatch ``SHIFT`` and its
TIS weight ``min(e^SHIFT, tis_cap)``; with plain SGD the update is then exactly that multiple of
the uncorrected one.
"""

from __future__ import annotations

import math

import pytest
import torch
from rl_helpers import RecordingModule, train

from periodic_rl import RLModule
from periodic_rl.models import load_causal_lm
from periodic_rl.rollout.engines.hf_engine import HFEngine

T = 0.7


class Shifted(RecordingModule):
    """Behaviour log-probs lowered by ``shift`` (as if the engine found every token less
    likely than the trainer does)."""

    shift = 0.0

    def _backward_micro_batch(self, groups):
        for group in groups:
            group.logprobs = [[v - self.shift for v in row] for row in group.logprobs]
        return super()._backward_micro_batch(groups)


def shifted(shift: float) -> type[Shifted]:
    return type(f"Shifted{shift}", (Shifted,), {"shift": shift})


class IdsOnlyHF(HFEngine):
    """A user's engine that overrides ``generate`` only: its groups carry no log-probs."""

    def generate(self, requests, sampling):
        return super().generate(requests, sampling)


def _run(path: str, module_cls=RecordingModule, **kwargs):
    params, module, _ = train(path, steps=1, temperature=T, module_cls=module_cls, **kwargs)
    logged = {k: float(v) for k, v in module.trainer.callback_metrics.items()}
    return params, module.last_iteration.metrics(), logged


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    return _run(tiny_llama_path)


@pytest.fixture(scope="module")
def initial(tiny_llama_path):
    model = load_causal_lm(tiny_llama_path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_scaled_update(params, plain_params, initial, factor: float) -> None:
    worst = 0.0
    for name, value in params.items():
        expected = initial[name] + factor * (plain_params[name] - initial[name])
        worst = max(worst, (value - expected).abs().max().item())
    assert worst < 1e-5, f"update is not {factor:.6f} x the plain one (max diff {worst:.2e})"


def test_hf_engine_mismatch_is_zero_and_logged(plain):
    _, metrics, logged = plain
    assert metrics["mismatch/abs_logp"] < 1e-5
    assert 0 <= metrics["mismatch/kl"] < 1e-10
    assert "mismatch/tis_weight" not in metrics  # tis_cap=None
    for name in ("mismatch/abs_logp", "mismatch/kl"):  # through RLMetrics, every iteration
        assert logged[name] == pytest.approx(metrics[name], abs=1e-9)


def test_shifted_behaviour_shows_as_mismatch_and_tis_scales_the_update(
    tiny_llama_path, plain, initial
):
    shift = 0.1  # weight e^0.1 = 1.10517 < cap
    params, metrics, _ = _run(tiny_llama_path, shifted(shift), tis_cap=2.0)
    assert metrics["mismatch/abs_logp"] == pytest.approx(shift, abs=1e-5)
    assert metrics["mismatch/kl"] == pytest.approx(math.exp(shift) - shift - 1, abs=1e-6)
    assert metrics["mismatch/tis_weight"] == pytest.approx(math.exp(shift), abs=1e-5)
    assert metrics["mismatch/tis_capped_frac"] == 0.0
    for name in ("ratio_mean", "ratio_max", "ratio_min"):  # every token's ratio is e^shift
        assert metrics[f"mismatch/{name}"] == pytest.approx(math.exp(shift), abs=1e-5)
    assert metrics["mismatch/ess"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["mismatch/missing_tokens"] == 0
    _assert_scaled_update(params, plain[0], initial, math.exp(shift))


class PerGroupShift(RecordingModule):
    """Group ``i``'s behaviour log-probs lowered by ``SHIFTS[i]``; its log-probs dropped where
    that is None (an engine that returned none for it). One group per micro-batch."""

    SHIFTS = {0: 0.2, 1: -0.3, 2: None}

    def _backward_micro_batch(self, groups, first=None):
        if first is None:
            for group in groups:
                shift = self.SHIFTS[group.index]
                group.logprobs = (
                    [] if shift is None else [[v - shift for v in r] for r in group.logprobs]
                )
        return super()._backward_micro_batch(groups, first)


def test_ratio_extremes_ess_and_missing_tokens_over_the_iteration(tiny_llama_path):
    """Three micro-batches: ratios e^0.2 and e^-0.3 in the first two, none in the third. The
    extremes are kept across micro-batches, not summed; the third group's tokens are missing
    and left out of the ratio statistics."""
    _, module, _ = train(
        tiny_llama_path,
        steps=2,  # one iteration of two updates
        temperature=T,
        module_cls=PerGroupShift,
        mask_truncated_completions=False,
        num_iterations=2,  # the second pass over the micro-batches adds no mismatch
    )
    stats = module.last_iteration
    metrics = stats.metrics()
    tokens = {g.index: sum(len(c) for c in g.completion_ids) for g in stats.groups}
    weights = {0: math.exp(0.2), 1: math.exp(-0.3)}
    n = tokens[0] + tokens[1]
    total = sum(tokens[i] * w for i, w in weights.items())
    squares = sum(tokens[i] * w * w for i, w in weights.items())
    assert metrics["mismatch/missing_tokens"] == tokens[2]
    assert metrics["mismatch/ratio_max"] == pytest.approx(weights[0], abs=1e-5)
    assert metrics["mismatch/ratio_min"] == pytest.approx(weights[1], abs=1e-5)
    assert metrics["mismatch/ratio_mean"] == pytest.approx(total / n, abs=1e-5)
    assert metrics["mismatch/ess"] == pytest.approx(total * total / (n * squares), abs=1e-5)
    assert metrics["mismatch/ess"] < 0.99
    expected_abs = (0.2 * tokens[0] + 0.3 * tokens[1]) / n
    assert metrics["mismatch/abs_logp"] == pytest.approx(expected_abs, abs=1e-5)


def test_tis_weights_are_capped(tiny_llama_path, plain, initial):
    params, metrics, _ = _run(tiny_llama_path, shifted(1.0), tis_cap=2.0)  # e^1 > 2
    assert metrics["mismatch/abs_logp"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch/kl"] == pytest.approx(math.e - 2, abs=1e-5)
    assert metrics["mismatch/tis_weight"] == 2.0
    assert metrics["mismatch/tis_capped_frac"] == 1.0
    _assert_scaled_update(params, plain[0], initial, 2.0)


def test_engine_without_logprobs_trains_but_refuses_tis(tiny_llama_path):
    strategy = {"engine": "test_mismatch:IdsOnlyHF", "use_ray": False, "overlap": False}
    _, module, _ = train(
        tiny_llama_path, steps=1, temperature=T, strategy=strategy, mask_truncated_completions=False
    )
    stats = module.last_iteration
    mismatch = {k: v for k, v in stats.metrics().items() if k.startswith("mismatch/")}
    assert mismatch == {"mismatch/missing_tokens": stats.num_tokens}  # every token, nothing else
    with pytest.raises(ValueError, match=r"tis_cap=2.0 .* engine 'test_mismatch:IdsOnlyHF'"):
        train(tiny_llama_path, steps=1, temperature=T, strategy=strategy, tis_cap=2.0)


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_tis_cap_names_the_field(tiny_llama_path, cap):
    with pytest.raises(ValueError, match="tis_cap must be a finite number > 0"):
        RLModule(model=tiny_llama_path, tis_cap=cap)
