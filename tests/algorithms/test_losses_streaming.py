"""Streaming-exact normalisation: micro-batch sums, divided once, equal the one-shot loss.

The gradient is taken w.r.t. the parameters of a real (tiny) policy: a linear layer producing
logits over a small vocabulary, log_softmax, gather. Micro-batches have unequal numbers of
sequences and are padded only to their own longest completion, as a stream delivers them.
"""

from __future__ import annotations

import pytest
import torch

from periodic_rl.algorithms import (
    LOSS_TYPES,
    loss_denominator,
    loss_numerator,
    per_token_policy_loss,
    reference_loss,
)

EPS, EPS_HIGH, MAX_NEW = 0.2, 0.28, 8
B, T, H, V = 10, 6, 5, 7
LENGTHS = [6, 1, 3, 5, 2, 6, 4, 1, 3, 5]
SPLITS = {1: [10], 2: [3, 7], 4: [1, 4, 2, 3]}  # K micro-batches of unequal sizes


def make_iteration(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(H, V, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    data = {
        "model": model,
        "x": torch.randn(B, T, H, generator=gen, dtype=torch.float64),
        "tokens": torch.randint(0, V, (B, T), generator=gen),
        "mask": (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long(),
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
    }
    with torch.no_grad():
        logps = policy_logps(model, data["x"], data["tokens"])
    # old and reference policies differ from the current one, so both clips fire
    data["old"] = logps + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    data["ref"] = logps + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return data


def policy_logps(model: torch.nn.Module, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def reference_grads(d: dict, loss_type: str, beta: float, rows: torch.Tensor | None = None):
    """Gradient and value of the one-shot loss on the given sequences (default: all)."""
    rows = torch.arange(B) if rows is None else rows
    model = d["model"]
    model.zero_grad()
    logps = policy_logps(model, d["x"][rows], d["tokens"][rows])
    loss = reference_loss(
        logps,
        d["old"][rows],
        d["adv"][rows],
        d["mask"][rows],
        loss_type,
        EPS,
        EPS_HIGH,
        MAX_NEW,
        beta,
        d["ref"][rows] if beta > 0 else None,
    )
    loss.backward()
    return grads(model), loss.detach()


def stream(d: dict, loss_type: str, beta: float, chunks: list[torch.Tensor], world_size=1):
    """Backprop each micro-batch's numerator; return summed grads, numerator, counts, stats."""
    model = d["model"]
    model.zero_grad()
    numerator, sequences, tokens, stats = 0.0, 0, 0, {}
    for rows in chunks:
        width = int(d["mask"][rows].sum(1).max())  # pad each micro-batch to its own longest
        x, tok = d["x"][rows, :width], d["tokens"][rows, :width]
        mask = d["mask"][rows, :width]
        logps = policy_logps(model, x, tok)
        per_token, s = per_token_policy_loss(
            logps,
            d["old"][rows, :width],
            d["adv"][rows],
            mask,
            EPS,
            EPS_HIGH,
            beta,
            d["ref"][rows, :width] if beta > 0 else None,
        )
        num = loss_numerator(per_token, mask, loss_type)
        num.backward()
        numerator += num.item()
        sequences += len(rows)
        tokens += int(s["tokens"])
        for k, v in s.items():
            stats[k] = stats.get(k, 0.0) + v.item()
    return grads(model), numerator, sequences, tokens, stats


def chunked(order: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(order, sizes))


def assert_grads_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_setup_clips_on_both_sides():
    d = make_iteration()
    _, _, _, _, stats = stream(d, "bnpo", 0.0, [torch.arange(B)])
    assert stats["clipped_low_tokens"] > 0 and stats["clipped_high_tokens"] > 0
    assert stats["tokens"] == sum(LENGTHS)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("k", sorted(SPLITS))
def test_streamed_gradient_equals_one_shot(loss_type: str, beta: float, k: int):
    d = make_iteration()
    expected_grads, expected_loss = reference_grads(d, loss_type, beta)
    got, numerator, sequences, tokens, _ = stream(
        d, loss_type, beta, chunked(torch.arange(B), SPLITS[k])
    )
    den = loss_denominator(loss_type, sequences, tokens, MAX_NEW)
    assert numerator / den == pytest.approx(expected_loss.item(), rel=1e-10)
    assert_grads_equal([g / den for g in got], expected_grads)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_completion_order_does_not_matter(loss_type: str):
    d = make_iteration(seed=1)
    expected_grads, _ = reference_grads(d, loss_type, 0.05)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    got, _, sequences, tokens, _ = stream(d, loss_type, 0.05, chunked(order, SPLITS[4]))
    den = loss_denominator(loss_type, sequences, tokens, MAX_NEW)
    assert_grads_equal([g / den for g in got], expected_grads)


def test_stats_stream_exactly():
    d = make_iteration()
    *_, whole = stream(d, "dapo", 0.05, [torch.arange(B)])
    *_, parts = stream(d, "dapo", 0.05, chunked(torch.arange(B), SPLITS[4]))
    assert (
        whole.keys()
        == parts.keys()
        == {
            "tokens",
            "clipped_low_tokens",
            "clipped_high_tokens",
            "clipped_tokens",
            "kl_sum",
        }
    )
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_ranks_with_gradient_averaging(loss_type: str):
    """Simulated DDP: two ranks, 5 sequences each, gradients averaged (all-reduce mean)."""
    d = make_iteration(seed=2)
    ranks = [torch.arange(0, 5), torch.arange(5, 10)]
    splits = [[2, 3], [4, 1]]
    runs = [stream(d, loss_type, 0.05, chunked(r, s)) for r, s in zip(ranks, splits, strict=True)]
    # the caller's all-reduce (sum) of the counts
    global_seqs = sum(run[2] for run in runs)
    global_tokens = sum(run[3] for run in runs)
    den = loss_denominator(loss_type, global_seqs, global_tokens, MAX_NEW, world_size=2)
    per_rank = [[g / den for g in run[0]] for run in runs]
    averaged = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    expected, _ = reference_grads(d, loss_type, 0.05)  # every type: the one-batch loss
    assert_grads_equal(averaged, expected)


def test_trl_per_micro_batch_bnpo_depends_on_the_split():
    """TRL's bnpo (token mean per micro-batch / accumulation steps) changes with the split;
    the streamed one does not, and both agree when the iteration is one micro-batch."""
    d = make_iteration()

    def trl_bnpo(sizes: list[int]) -> float:
        total = 0.0
        for rows in chunked(torch.arange(B), sizes):
            with torch.no_grad():
                logps = policy_logps(d["model"], d["x"][rows], d["tokens"][rows])
                total += reference_loss(
                    logps,
                    d["old"][rows],
                    d["adv"][rows],
                    d["mask"][rows],
                    "bnpo",
                    EPS,
                    EPS_HIGH,
                    MAX_NEW,
                ).item() / len(sizes)
        return total

    _, one_shot = reference_grads(d, "bnpo", 0.0)
    assert trl_bnpo(SPLITS[1]) == pytest.approx(one_shot.item(), rel=1e-12)
    assert trl_bnpo(SPLITS[4]) != pytest.approx(one_shot.item(), rel=1e-3)
    _, numerator, _, tokens, _ = stream(d, "bnpo", 0.0, chunked(torch.arange(B), SPLITS[4]))
    assert numerator / loss_denominator("bnpo", B, tokens, MAX_NEW) == pytest.approx(
        one_shot.item(), rel=1e-12
    )
