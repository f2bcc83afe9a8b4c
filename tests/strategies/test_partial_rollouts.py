"""Partial rollouts through the strategy and RLModule, on the in-process engine.

With ``max_staleness: 1`` and ``partial_rollout_tokens: 3``, iteration ``j`` starts at version
``j - 1``; the completions still running after 3 tokens continue under version ``j``. Each token
must carry the version that drew it, its behaviour log-prob must be that version's, and the
update must be the importance-corrected gradient written out here, token by token. Exactly
on-policy, no completion is ever continued under other weights.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import (
    StaleRecording,
    assert_same_update,
    completion_logps,
    fit_checkpointed,
    max_diff,
    train,
)

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.rollout import chooser as chooser_module

LOCAL = {"engine": "hf", "use_ray": False, "overlap": False}
PARTIAL = {**LOCAL, "max_staleness": 1, "partial_rollout_tokens": 3}


def _load(model, weights) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def test_a_completion_spanning_an_update_trains_with_each_tokens_own_version(tiny_llama_path):
    lr = 0.5
    trained_after, module, strategy = train(
        tiny_llama_path, steps=3, strategy=PARTIAL, module_cls=StaleRecording, learning_rate=lr
    )
    groups = module.trained_groups[2]  # chunks by versions 1, 2, 2
    assert {g.version for g in groups} == {1}
    spanning = 0
    for group in groups:
        assert set(group.version_fingerprints) <= {1, 2}
        for ids, versions in zip(group.completion_ids, group.token_versions, strict=True):
            assert versions == [1] * min(3, len(ids)) + [2] * (len(ids) - 3)
            spanning += len(set(versions)) > 1
    assert spanning > 0, "no completion ran past its first chunk: nothing was tested"
    assert module.trained_groups[0][0].token_versions == []  # iteration 0: version 0 throughout
    # every token's behaviour log-prob is that of the weights of the version it is tagged with
    model = module.policy
    by_version = {}
    for version in (1, 2):
        _load(model, module.started_from[version])
        with torch.no_grad():
            by_version[version] = [
                completion_logps(model, g.prompt_ids, ids)
                for g in groups
                for ids in g.completion_ids
            ]
    rows = [(b, v) for g in groups for b, v in zip(g.logprobs, g.token_versions, strict=True)]
    for n, (behaviour, versions) in enumerate(rows):
        own = torch.tensor([by_version[v][n][t].item() for t, v in enumerate(versions)])
        assert torch.allclose(own, torch.tensor(behaviour), atol=1e-5), n
        if 2 in versions:  # the other version's weights would not explain those tokens
            other = by_version[1][n][versions.index(2) :]
            assert (other - torch.tensor(behaviour[versions.index(2) :])).abs().max() > 1e-3
    # iteration 2's SGD step from version 2's weights: -lr * d/dtheta of
    # sum_t -min(exp(logp_t - b_t), 2) * A * logp_t / N, b_t the log-prob of token t's own version
    _load(model, module.started_from[2])
    model.zero_grad()
    tokens = sum(len(c) for g in groups for c in g.completion_ids)
    loss = 0.0
    for group in groups:
        for ids, behaviour, advantage in zip(
            group.completion_ids, group.logprobs, group.advantages, strict=True
        ):
            logps = completion_logps(model, group.prompt_ids, ids)
            w = torch.clamp(torch.exp(logps.detach() - torch.tensor(behaviour)), max=2.0)
            loss = loss + (-(w * advantage * logps)).sum() / tokens
    loss.backward()
    expected = {n: module.started_from[2][n] - lr * p.grad for n, p in model.named_parameters()}
    worst = max((trained_after[n] - expected[n]).abs().max().item() for n in trained_after)
    assert worst < 1e-5, f"not the per-token corrected gradient (max diff {worst:.2e})"
    metrics = module.last_iteration.metrics()
    assert 0 < metrics["staleness/tokens_updated"] < 1


def test_exactly_on_policy_never_continues_a_completion_under_other_weights(
    tiny_llama_path, monkeypatch
):
    with pytest.raises(ValueError, match="partial_rollout_tokens needs max_staleness >= 1"):
        PeriodicAsyncStrategy(engine="hf", partial_rollout_tokens=3)
    # allowed by a budget, but the run stays on-policy (staleness predicted far slower)
    monkeypatch.setattr(chooser_module, "predict_period_s", lambda times, k, cycles=8: 1e9)
    budget = {**LOCAL, "asynchrony": {"max_staleness": 1}, "asynchrony_window": 1}
    _, module, strategy = train(
        tiny_llama_path,
        steps=4,
        strategy={**budget, "partial_rollout_tokens": 3},
        module_cls=StaleRecording,
    )
    assert all(not d.switch for d in strategy.schedule_chooser.decisions)
    for iteration, groups in enumerate(module.trained_groups):
        assert all(g.version == iteration and g.token_versions == [] for g in groups)
    assert any(len(c) > 3 for g in module.trained_groups[-1] for c in g.completion_ids)


def test_partial_rollouts_with_dynamic_sampling_are_refused_before_training(tiny_llama_path):
    with pytest.raises(ValueError, match="dynamic_sampling with partial_rollout_tokens"):
        train(tiny_llama_path, steps=2, strategy=PARTIAL, dynamic_sampling=True)


def test_overlapped_on_two_ray_workers_equals_synchronous(tiny_llama_path, local_ray):
    """The chunk versions are the schedule's: the overlapped run, whose chunks may wait for the
    trainer's next version, trains on the same tokens as the synchronous one."""
    ray_workers = {**PARTIAL, "use_ray": True, "num_workers": 2, "groups_per_call": 1}
    kwargs = dict(steps=3, module_cls=StaleRecording)
    sync = train(tiny_llama_path, strategy={**ray_workers, "overlap": False}, **kwargs)
    overlapped = train(tiny_llama_path, strategy={**ray_workers, "overlap": True}, **kwargs)
    assert_same_update(sync, overlapped, "partial rollouts overlapped on two Ray workers")
    spans = [
        g for g in overlapped[1].trained_groups[2] if any(len(set(v)) > 1 for v in g.token_versions)
    ]
    assert spans, "no completion spanned an update"


def test_a_resumed_run_equals_the_uninterrupted_one(tiny_llama_path, tmp_path):
    """Interrupted after 2 of 4 iterations: iteration 2's chunks are drawn by versions 1 and
    2 again, the checkpoint keeping version 1's weights."""

    def fit(root, steps, ckpt_path=None):
        strategy = PeriodicAsyncStrategy(**PARTIAL)
        return fit_checkpointed(tiny_llama_path, root, steps, strategy, ckpt_path, max_new_tokens=8)

    straight, _ = fit(tmp_path / "a", 4)
    fit(tmp_path / "b", 2)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    resumed, _ = fit(tmp_path / "b", 4, ckpt_path=str(last))
    assert max_diff(straight, resumed) == 0.0
