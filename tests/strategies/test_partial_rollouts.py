"""Partial rollouts through the strategy and RLModule, on the in-process engine.

With ``max_staleness: 1`` and ``partial_rollout_tokens: 3``, iteration ``j`` starts at version
``j - 1``; the completions still running after 3 tokens continue under version ``j``. Each token
must carry the version that drew it, its behaviour log-prob must be that version's, and the
update must be the importance-corrected gradient written out here, token by token. Exactly
on-policy, no completion is ever continued under other weights.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rl_helpers import RecordingModule, assert_same_update, length_reward, max_diff, train

from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
from periodic_rl.rollout import chooser as chooser_module

LOCAL = {"engine": "hf", "use_ray": False, "overlap": False}
PARTIAL = {**LOCAL, "max_staleness": 1, "partial_rollout_tokens": 3}


class Recording(RecordingModule):
    """Also keeps the weights each iteration started from (version ``j``'s for iteration
    ``j``) and the groups it trained on."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.started_from: list[dict[str, torch.Tensor]] = []
        self.trained_groups: list[list] = []

    def training_step(self, batch, batch_idx):
        self.started_from.append(
            {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        )
        super().training_step(batch, batch_idx)
        self.trained_groups.append(self.last_iteration.groups)


def _load(model, weights) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def _logps(model, prompt_ids, completion_ids) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def test_a_completion_spanning_an_update_trains_with_each_tokens_own_version(tiny_llama_path):
    lr = 0.5
    trained_after, module, strategy = train(
        tiny_llama_path, steps=3, strategy=PARTIAL, module_cls=Recording, learning_rate=lr
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
                _logps(model, g.prompt_ids, ids) for g in groups for ids in g.completion_ids
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
            logps = _logps(model, group.prompt_ids, ids)
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
        module_cls=Recording,
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
    kwargs = dict(steps=3, module_cls=Recording)
    sync = train(tiny_llama_path, strategy={**ray_workers, "overlap": False}, **kwargs)
    overlapped = train(tiny_llama_path, strategy={**ray_workers, "overlap": True}, **kwargs)
    assert_same_update(sync, overlapped, "partial rollouts overlapped on two Ray workers")
    spans = [
        g for g in overlapped[1].trained_groups[2] if any(len(set(v)) > 1 for v in g.token_versions)
    ]
    assert spans, "no completion spanned an update"


def _fit_checkpointed(model_path, root, steps, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    module = RLModule(
        model=model_path, num_generations=2, micro_batch_size=2, max_new_tokens=8,
        learning_rate=1e-3, reward_funcs=[length_reward],
    )  # fmt: skip
    trainer = L.Trainer(
        strategy=PeriodicAsyncStrategy(**PARTIAL),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PromptDataModule(batch_size=2, num_train=40, num_val=0),
                ckpt_path=ckpt_path)  # fmt: skip
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def test_a_resumed_run_equals_the_uninterrupted_one(tiny_llama_path, tmp_path):
    """Interrupted after 2 of 4 iterations: iteration 2's chunks are drawn by versions 1 and
    2 again, the checkpoint keeping version 1's weights."""
    straight = _fit_checkpointed(tiny_llama_path, tmp_path / "a", 4)
    _fit_checkpointed(tiny_llama_path, tmp_path / "b", 2)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    resumed = _fit_checkpointed(tiny_llama_path, tmp_path / "b", 4, ckpt_path=str(last))
    assert max_diff(straight, resumed) == 0.0
