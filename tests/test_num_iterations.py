"""``num_iterations`` (mu > 1 updates per generated batch) against a two-epoch computation
written out here: the first update at ratio 1, the second clipped against the first pass's
log-probs, each an SGD step on the iteration's token-normalised (``dapo``) loss."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import RecordingModule, train

EPS = 0.2


class StartRecording(RecordingModule):
    """Keeps the trainable weights each iteration started from."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.started_from: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.started_from.append(
            {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        )
        return super().training_step(batch, batch_idx)


def _logps(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def _sgd_step(model, groups, lr, old=None):
    """One SGD step on the clipped surrogate; returns the detached log-probs (the old policy of
    the next update) and the ratios."""
    model.zero_grad()
    tokens = sum(len(c) for g in groups for c in g.completion_ids)
    loss, seen, ratios = 0.0, [], []
    for group in groups:
        for ids, advantage in zip(group.completion_ids, group.advantages, strict=True):
            logps = _logps(model, group.prompt_ids, ids)
            before = old[len(seen)] if old is not None else logps.detach()
            ratio = torch.exp(logps - before)
            clipped = torch.clamp(ratio, 1 - EPS, 1 + EPS)
            loss = loss + (-torch.minimum(ratio * advantage, clipped * advantage)).sum() / tokens
            seen.append(logps.detach())
            ratios.append(ratio.detach())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
    return seen, torch.cat(ratios)


def test_two_updates_equal_the_written_out_two_epoch_computation(tiny_llama_path):
    lr = 2.0  # large enough that the second update's ratios leave the clip range
    params, module, strategy = train(
        tiny_llama_path,
        steps=4,
        module_cls=StartRecording,
        learning_rate=lr,
        num_iterations=2,
        epsilon=EPS,
    )
    assert strategy.policy_version == 4 and len(module.records) == 2
    assert [r.version for r in module.records] == [0, 2]  # pushed after every second step
    assert [{v for v, _ in r.stamps} for r in module.records] == [{0}, {2}]
    assert strategy.push_counts["full"] == 3  # setup + one push per iteration
    assert module.last_iteration.metrics()["clip_fraction"] > 0  # the second update clips

    model = module.policy
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(module.started_from[1][name])
    groups = module.last_iteration.groups
    old, first_ratios = _sgd_step(model, groups, lr)
    assert torch.equal(first_ratios, torch.ones_like(first_ratios))
    _, second_ratios = _sgd_step(model, groups, lr, old)
    assert ((second_ratios - 1).abs() > EPS).any(), "no ratio was clipped: a weak test"
    worst = max(
        (params[n] - p.detach()).abs().max().item()
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    assert worst < 1e-5, f"two updates differ from the written-out computation ({worst:.2e})"


def test_num_iterations_one_is_the_plain_step(tiny_llama_path):
    plain = train(tiny_llama_path, steps=2)
    explicit = train(tiny_llama_path, steps=2, num_iterations=1)
    assert all(torch.equal(plain[0][k], explicit[0][k]) for k in plain[0])


@pytest.mark.parametrize(
    ("steps", "strategy", "match"),
    [
        (3, None, r"max_steps \(3\) .* multiple of num_iterations \(2\), e.g. max_steps: 4"),
        (
            4,
            {"engine": "hf", "use_ray": False, "overlap": False, "max_staleness": 1},
            "num_iterations=2 with max_staleness=1",
        ),
    ],
    ids=["max-steps", "staleness"],
)
def test_bad_combinations_are_refused_before_training(tiny_llama_path, steps, strategy, match):
    with pytest.raises(ValueError, match=match):
        train(tiny_llama_path, steps=steps, strategy=strategy, num_iterations=2)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_bad_num_iterations_names_the_field(tiny_llama_path, value):
    from periodic_rl import RLModule

    with pytest.raises(ValueError, match="num_iterations must be an integer >= 1"):
        RLModule(model=tiny_llama_path, num_iterations=value)
