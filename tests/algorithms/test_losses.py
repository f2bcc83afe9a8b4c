"""Clipped surrogate and loss types against hand-computed values; validation of the API."""

from __future__ import annotations

import math

import pytest
import torch

from periodic_rl.algorithms import (
    LOSS_TYPES,
    check_loss_type,
    loss_denominator,
    loss_numerator,
    per_token_policy_loss,
    reference_loss,
)

EPS, EPS_HIGH = 0.2, 0.28  # clip range [0.8, 1.28]
MAX_NEW = 4
KL_TOKEN = 1 - math.log(2)  # k3 at ref - logp = ln 2: 2 - ln 2 - 1 = 0.30685282


def hand_case(beta: float = 0.0):
    """Two sequences, T = 3, old log-probs -1, ratios chosen to hit every clip branch.

    seq 0, A = +1, ratios [1.0, 1.5, 0.5], 3 tokens:
        1.0: min(1.0, 1.0) = 1.0             -> loss -1.0
        1.5: min(1.5, 1.28) = 1.28           -> loss -1.28  (high clip: r > 1.28, A > 0)
        0.5: min(0.5, 0.8) = 0.5             -> loss -0.5   (r < 0.8 but A > 0: not clipped)
    seq 1, A = -2, ratios [0.5, 1.5, pad], 2 tokens:
        0.5: min(-1.0, 0.8 * -2 = -1.6)      -> loss  1.6   (low clip: r < 0.8, A < 0)
        1.5: min(-3.0, 1.28 * -2 = -2.56)    -> loss  3.0   (r > 1.28 but A < 0: not clipped)
    sums: seq 0 = -2.78, seq 1 = 4.6, all = 1.82 over 5 tokens.
    The padding slot holds +inf log-probs: it must not leak into anything.
    """
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]], dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logps = old + ratios.log()
    logps[1, 2] = math.inf
    logps.requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ref = (logps.detach() + math.log(2)) if beta > 0 else None  # k3 = 1 - ln 2 per token
    return logps, old, advantages, mask, ref


EXPECTED_PER_TOKEN = [[-1.0, -1.28, -0.5], [1.6, 3.0, 0.0]]
EXPECTED = {
    # mean over sequences of per-sequence means: (-2.78 / 3 + 4.6 / 2) / 2
    "grpo": (-2.78 / 3 + 4.6 / 2) / 2,  # 0.68666667
    "bnpo": 1.82 / 5,  # 0.364
    "dapo": 1.82 / 5,  # 0.364 (one process: the same tokens)
    "dr_grpo": 1.82 / (2 * MAX_NEW),  # 0.2275
}
# beta = 0.1 adds 0.1 * (1 - ln 2) = 0.030685282 to each of the 5 tokens
EXPECTED_KL = {
    "grpo": EXPECTED["grpo"] + 0.1 * KL_TOKEN,  # 0.71735195
    "bnpo": EXPECTED["bnpo"] + 0.1 * KL_TOKEN,  # 0.39468528
    "dapo": EXPECTED["dapo"] + 0.1 * KL_TOKEN,
    "dr_grpo": (1.82 + 5 * 0.1 * KL_TOKEN) / (2 * MAX_NEW),  # 0.24667830
}


def test_expected_numbers_written_out():
    assert EXPECTED["grpo"] == pytest.approx(0.6866667, abs=1e-7)
    assert EXPECTED_KL["grpo"] == pytest.approx(0.7173520, abs=1e-7)
    assert EXPECTED_KL["bnpo"] == pytest.approx(0.3946853, abs=1e-7)
    assert EXPECTED_KL["dr_grpo"] == pytest.approx(0.2466783, abs=1e-7)


def test_per_token_loss_and_stats():
    logps, old, adv, mask, _ = hand_case()
    per_token, stats = per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH)
    torch.testing.assert_close(per_token, torch.tensor(EXPECTED_PER_TOKEN, dtype=torch.float64))
    assert stats["tokens"].item() == 5
    assert stats["clipped_low_tokens"].item() == 1
    assert stats["clipped_high_tokens"].item() == 1
    assert stats["clipped_tokens"].item() == 2
    assert "kl_sum" not in stats
    assert not any(v.requires_grad for v in stats.values())


def test_per_token_loss_with_kl():
    logps, old, adv, mask, ref = hand_case(beta=0.1)
    per_token, stats = per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH, 0.1, ref)
    expected = torch.tensor(EXPECTED_PER_TOKEN, dtype=torch.float64) + 0.1 * KL_TOKEN
    expected[1, 2] = 0.0
    torch.testing.assert_close(per_token, expected)
    torch.testing.assert_close(stats["kl_sum"].item(), 5 * KL_TOKEN)  # 1.5342641


def test_kl_reported_without_penalty():
    logps, old, adv, mask, _ = hand_case()
    ref = logps.detach() + math.log(2)
    per_token, stats = per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH, ref_logps=ref)
    torch.testing.assert_close(per_token, torch.tensor(EXPECTED_PER_TOKEN, dtype=torch.float64))
    torch.testing.assert_close(stats["kl_sum"].item(), 5 * KL_TOKEN)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_values(loss_type: str, beta: float):
    logps, old, adv, mask, ref = hand_case(beta)
    expected = (EXPECTED_KL if beta else EXPECTED)[loss_type]
    ref_value = reference_loss(logps, old, adv, mask, loss_type, EPS, EPS_HIGH, MAX_NEW, beta, ref)
    assert ref_value.item() == pytest.approx(expected, abs=1e-12)
    # streamed form with a single micro-batch
    per_token, stats = per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH, beta, ref)
    num = loss_numerator(per_token, mask, loss_type)
    den = loss_denominator(loss_type, 2, int(stats["tokens"]), MAX_NEW)
    assert (num / den).item() == pytest.approx(expected, abs=1e-12)
    # the +inf padding did not leak into the gradient
    num.backward()
    assert torch.isfinite(logps.grad).all()
    assert logps.grad[1, 2].item() == 0.0


def test_gradient_at_ratio_one():
    # old = logps.detach(): ratio 1, no clipping; d(-r A)/dlogp = -A. grpo divides by length.
    logps = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    per_token, _ = per_token_policy_loss(logps, logps.detach(), adv, mask, EPS, EPS_HIGH)
    loss_numerator(per_token, mask, "grpo").backward()
    expected = torch.tensor([[-1 / 3, -1 / 3, -1 / 3], [1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected)


def test_numerator_values():
    per_token = torch.tensor(EXPECTED_PER_TOKEN, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert loss_numerator(per_token, mask, "grpo").item() == pytest.approx(-2.78 / 3 + 2.3)
    for loss_type in ("bnpo", "dr_grpo", "dapo"):
        assert loss_numerator(per_token, mask, loss_type).item() == pytest.approx(1.82)
    # an empty completion counts as length 1 in grpo (TRL's clamp), contributing 0
    empty = torch.zeros(1, 3, dtype=torch.float64)
    assert loss_numerator(empty, torch.zeros(1, 3), "grpo").item() == 0.0


def test_denominator_values():
    assert loss_denominator("grpo", 10, 37, 8) == 10.0
    assert loss_denominator("bnpo", 10, 37, 8) == 37.0
    assert loss_denominator("dapo", 10, 37, 8) == 37.0
    assert loss_denominator("dapo", 10, 80, 8, world_size=4) == 20.0  # TRL: N / num_processes
    assert loss_denominator("bnpo", 10, 80, 8, world_size=4) == 20.0  # global token mean
    assert loss_denominator("grpo", 40, 80, 8, world_size=4) == 10.0  # global sequence mean
    assert loss_denominator("dr_grpo", 10, 37, 8) == 80.0
    assert loss_denominator("bnpo", 3, 0, 8) == 1.0  # no tokens: clamp, as TRL


def test_validation():
    logps, old, adv, mask, _ = hand_case()
    with pytest.raises(ValueError, match="needs ref_logps"):
        per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH, beta=0.1)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        per_token_policy_loss(logps, old, adv, mask, EPS, EPS_HIGH, beta=-1.0)
    with pytest.raises(ValueError, match="advantages must be"):
        per_token_policy_loss(logps, old, adv[:1], mask, EPS, EPS_HIGH)
    with pytest.raises(ValueError, match="old_logps has shape"):
        per_token_policy_loss(logps, old[:, :2], adv, mask, EPS, EPS_HIGH)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        per_token_policy_loss(logps[0], old[0], adv, mask[0], EPS, EPS_HIGH)
    with pytest.raises(ValueError, match="num_sequences >= 1"):
        loss_denominator("grpo", 0, 5, 4)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        loss_denominator("dr_grpo", 2, 5, 0)
    with pytest.raises(ValueError, match="world_size"):
        loss_denominator("dapo", 2, 5, 4, world_size=0)


def test_check_loss_type():
    assert LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo")
    for name in LOSS_TYPES:
        assert check_loss_type(name) == name
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo"):
        check_loss_type("ppo")
    with pytest.raises(ValueError, match="allowed values"):
        loss_numerator(torch.zeros(1, 1), torch.ones(1, 1), "sapo")
    with pytest.raises(ValueError, match="allowed values"):
        loss_denominator("cispo", 1, 1, 1)
    with pytest.raises(ValueError, match="allowed values"):
        reference_loss(*hand_case()[:4], "luspo", EPS, EPS_HIGH, MAX_NEW)


# ---- truncated importance sampling (TIS) ------------------------------------------------------
def tis_case():
    """Two sequences, T = 2 (the second has one token), TIS cap C = 1.5.

    trainer log-probs [[-1.0, -2.0], [-0.5, pad]], behaviour [[-1.5, -1.0], [-0.5, pad]]:
        w = min(exp(old - behaviour), 1.5) = [[min(e^0.5 = 1.6487, 1.5) = 1.5,
                                               e^-1 = 0.36787944], [e^0 = 1.0, 0 (pad)]]
    ratio 1 (old = trainer, detached), A = [+2, -1]: loss = -w * A per token
        = [[-3.0, -0.73575888], [1.0, 0]], sum -2.73575888
    With beta = 0.1 and ref [[-1.2, -2.0], [-0.4, pad]] the k3 KL is added *unweighted*:
        kl = [[e^-0.2 + 0.2 - 1 = 0.01873075, 0], [e^0.1 - 0.1 - 1 = 0.00517092, 0]]
        loss = [[-3.0 + 0.00187308, -0.73575888], [1.0 + 0.00051709, 0]]
    """
    logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -1.0], [-0.5, float("-inf")]])  # padding: any value
    ref = torch.tensor([[-1.2, -2.0], [-0.4, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logps, behaviour, ref, mask, torch.tensor([2.0, -1.0])


def test_tis_weights_and_loss_written_out():
    from periodic_rl.algorithms.losses import truncated_is_weights

    logps, behaviour, ref, mask, advantages = tis_case()
    weights = truncated_is_weights(logps, behaviour, mask, cap=1.5)
    expected_w = torch.tensor([[1.5, 0.36787944], [1.0, 0.0]])
    torch.testing.assert_close(weights, expected_w, rtol=0, atol=1e-7)
    assert not weights.requires_grad

    args = (logps, logps.detach(), advantages, mask, EPS, EPS_HIGH)
    per_token, _ = per_token_policy_loss(*args, is_weights=weights)
    expected = torch.tensor([[-3.0, -0.73575888], [1.0, 0.0]])
    torch.testing.assert_close(per_token, expected, rtol=0, atol=1e-6)
    numerator = loss_numerator(per_token, mask, "dapo")
    assert numerator.item() == pytest.approx(-2.73575888, abs=1e-6)
    numerator.backward()  # d/dlogp of -w * ratio * A at ratio 1 is -w * A
    torch.testing.assert_close(logps.grad, expected, rtol=0, atol=1e-6)

    with_kl, stats = per_token_policy_loss(*args, beta=0.1, ref_logps=ref, is_weights=weights)
    expected_kl = torch.tensor([[-3.0 + 0.00187308, -0.73575888], [1.0 + 0.00051709, 0.0]])
    torch.testing.assert_close(with_kl, expected_kl, rtol=0, atol=1e-6)
    assert stats["kl_sum"].item() == pytest.approx(0.01873075 + 0.00517092, abs=1e-6)


def test_tis_unit_weights_change_nothing_and_bad_caps_are_refused():
    from periodic_rl.algorithms.losses import truncated_is_weights

    logps, behaviour, ref, mask, advantages = tis_case()
    args = (logps, logps.detach() + 0.1, advantages, mask, EPS, EPS_HIGH)
    plain, plain_stats = per_token_policy_loss(*args, beta=0.1, ref_logps=ref)
    ones, ones_stats = per_token_policy_loss(
        *args, beta=0.1, ref_logps=ref, is_weights=torch.ones_like(mask)
    )
    assert torch.equal(plain, ones) and plain_stats.keys() == ones_stats.keys()
    for cap in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cap must be > 0"):
            truncated_is_weights(logps, behaviour, mask, cap)
    with pytest.raises(ValueError, match="is_weights has shape"):
        per_token_policy_loss(*args, is_weights=torch.ones(2, 3))
