"""Multi-turn trajectories train on the model's tokens only (:mod:`periodic_rl.loss_mask`).

The unit tests lay the loss masks out like the trainer's ``[N, T]`` tensors and count the token
normaliser. The training tests (tiny model, in-process HF engine, plain SGD) declare tokens 3 and
4 of every sampled completion an environment reply (tests/trajectory_helpers.py): the update is
the gradient of the loss written out here over the model's tokens alone; all-ones masks train
exactly as single-turn groups; packed shared-prompt forwards equal padded ones; the mismatch
metrics and the importance weights never see an environment token; the agent metrics are
logged.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import ORDER_TOLERANCE, RecordingModule, assert_same_update, max_diff, train
from trajectory_helpers import (
    OnesTrajectoryModule,
    TrajectoryModule,
    made_up_trajectory,
)

from periodic_rl.iteration import IterationStats
from periodic_rl.loss_mask import apply_loss_masks, check_trajectories, loss_mask_tensor
from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.rollout.types import RolloutGroup, Trajectory, Turn

LR = 0.5  # train()'s SGD learning rate, no gradient clipping
#: Largest parameter difference between the trainer's update and the one written out here with
#: a plain, unpadded forward per completion (another float summation order), as in
#: tests/test_truncation_training.py. Measured: 6e-8 at most; the mask left off moves the weights
#: by 2.6e-2, environment tokens in the dapo normaliser by 1.2e-2.
INDEPENDENT_TOLERANCE = 1e-6


def group(index: int, completions: list[list[int]], masks: list[list[int]] | None = None):
    trajectories = []
    if masks is not None:
        trajectories = [
            Trajectory(loss_mask=m, turns=(Turn(start=0, model_tokens=sum(m)),)) for m in masks
        ]
    return RolloutGroup(
        index=index,
        prompt="p",
        prompt_ids=[1, 2],
        completion_ids=completions,
        completions=["c"] * len(completions),
        rewards=[float(i) for i in range(len(completions))],
        trajectories=trajectories,
    )


# ---- unit: the layout and the counts --------------------------------------------------------
def test_masks_are_laid_out_like_the_trainer_rows_padding_zeroed():
    """A single-turn group's rows stay ones (its padding included: the padding mask zeroes
    it); a trajectory row gets its mask from column 0 and zeros on its padding."""
    single = group(0, [[5, 6, 7], [5]])
    multi = group(1, [[5, 6, 7, 8], [5, 6]], masks=[[1, 0, 0, 1], [0, 1]])
    padding = torch.tensor(
        [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32
    )
    loss = loss_mask_tensor([single, multi], padding)
    assert loss.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1], [0, 1, 0, 0]]
    masked = apply_loss_masks(padding, [single, multi])
    assert masked.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 1], [0, 1, 0, 0]]
    assert masked.dtype == padding.dtype


def test_single_turn_groups_leave_the_mask_as_it_is():
    mask = torch.ones(2, 3)
    assert apply_loss_masks(mask, [group(0, [[1, 2, 3], [4, 5, 6]])]) is mask
    assert loss_mask_tensor([group(0, [[1, 2, 3], [4, 5, 6]])], mask) is None


def test_trajectories_that_do_not_line_up_are_refused():
    ids = [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="1 trajectories for 2 completions"):
        check_trajectories([made_up_trajectory(ids[0], 0)], ids)
    short = Trajectory(loss_mask=[1, 1], turns=())
    with pytest.raises(ValueError, match="completion 0: a loss mask of 2 entries for 3 tokens"):
        check_trajectories([short, made_up_trajectory(ids[1], 1)], ids)
    with pytest.raises(ValueError, match="only 0 and 1"):
        check_trajectories([Trajectory(loss_mask=[1, 2, 1], turns=()), short], ids)
    bad = group(0, [[5, 6, 7]], masks=[[1, 0]])
    with pytest.raises(ValueError, match="a loss mask of 2 entries for 3 tokens"):
        loss_mask_tensor([bad], torch.ones(1, 3))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_the_token_normaliser_counts_model_tokens_only(mask_truncated):
    """Environment tokens are never in it; a masked truncated completion's model tokens are
    not either (its environment tokens are not taken off twice)."""
    stats = IterationStats()
    single = group(0, [[1] * 5, [1] * 3])
    single.truncated = [True, False]
    multi = group(1, [[1] * 6, [1] * 4], masks=[[1, 0, 0, 1, 1, 1], [1, 1, 0, 0]])
    multi.truncated = [True, False]
    stats.add_groups([single, multi])
    assert stats.masked_tokens == 4 and stats.truncated_masked_tokens == 2
    truncated_model_tokens = 5 + 4 if mask_truncated else 0
    assert stats.loss_tokens(mask_truncated) == (5 + 3 + 4 + 2) - truncated_model_tokens


def test_agent_metrics_only_when_the_iteration_had_trajectories():
    stats = IterationStats()
    stats.add_groups([group(0, [[1, 2], [3, 4]])])
    assert not any(k.startswith(("agent/", "rollout/")) for k in stats.metrics())
    ids = [[1] * 8, [1] * 8, [1] * 4, [1] * 8]
    multi = group(1, ids)
    multi.trajectories = [made_up_trajectory(c, i) for i, c in enumerate(ids)]
    stats.add_groups([multi])
    metrics = stats.metrics()
    assert metrics["rollout/masked_tokens"] == 2 + 2 + 1 + 2  # tokens 3 and 4 of each
    assert metrics["agent/turns"] == (2 + 2 + 1 + 2) / 4  # the 4-token one has one turn
    assert metrics["agent/tool_calls"] == 1.0
    assert metrics["agent/tool_errors"] == 0.5
    assert metrics["agent/tool_timeouts"] == 0.0
    assert metrics["agent/tool_latency_s"] == pytest.approx((0.25 + 0.5 + 0.75 + 1.0) / 4)
    assert metrics["agent/env_truncated"] == 0.25
    assert metrics["agent/stop/done"] == 0.75 and metrics["agent/stop/length"] == 0.25
    assert metrics["agent/stop/max_turns"] == 0.0


# ---- training: the update ---------------------------------------------------------------------
def model_tokens(groups) -> int:
    return sum(sum(t.loss_mask) for g in groups for t in g.trajectories)


def expected_update(path: str, groups, loss_type: str, masked: bool = True, normaliser=None):
    """Parameters after one SGD step on the groups' loss, written out here: the policy from
    disk, one plain forward per completion, each token's surrogate ``-A * exp(logp -
    logp.detach())`` (ratio 1, no clipping, ``beta = 0``) kept where the loss mask is 1
    (``masked=False``: every token). ``dapo``: their sum over the kept tokens' count
    (``normaliser`` overrides it); ``grpo``: the mean over completions of each one's mean."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    terms, sequences, tokens = [], 0, 0
    for g in groups:
        for ids, advantage, trajectory in zip(
            g.completion_ids, g.advantages, g.trajectories, strict=True
        ):
            sequences += 1
            keep = torch.tensor(trajectory.loss_mask if masked else [1] * len(ids)).bool()
            tokens += int(keep.sum())
            x = torch.tensor([g.prompt_ids + ids])
            logits = model(input_ids=x).logits[0, len(g.prompt_ids) - 1 : -1]
            logps = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), ids]
            terms.append((advantage, torch.exp(logps - logps.detach())[keep]))
    if loss_type == "dapo":
        loss = sum(-a * ratio.sum() for a, ratio in terms) / (normaliser or tokens)
    else:
        loss = sum(-a * ratio.mean() for a, ratio in terms) / sequences
    loss.backward()
    return {n: (p - LR * p.grad).detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_environment_tokens_are_out_of_the_update(tiny_llama_path, loss_type):
    """One iteration in 3 micro-batches: the update is the one written out over the model's
    tokens, and clearly not the one over every token, nor (``dapo``) the masked sum over every
    token's count. The loss counted the model tokens only."""
    params, module, _ = train(
        tiny_llama_path, steps=1, module_cls=TrajectoryModule, loss_type=loss_type
    )
    stats = module.last_iteration
    groups = stats.groups
    assert len(groups) == 3 and all(len(g.trajectories) == 4 for g in groups)
    environment = sum(t.loss_mask.count(0) for g in groups for t in g.trajectories)
    assert environment > 0 and stats.masked_tokens == environment
    assert stats.loss["tokens"] == model_tokens(groups) == stats.num_tokens - environment

    expected = expected_update(tiny_llama_path, groups, loss_type)
    assert max_diff(params, expected) <= INDEPENDENT_TOLERANCE
    unmasked = expected_update(tiny_llama_path, groups, loss_type, masked=False)
    assert max_diff(params, unmasked) > 100 * INDEPENDENT_TOLERANCE
    if loss_type == "dapo":
        miscounted = expected_update(
            tiny_llama_path, groups, loss_type, normaliser=stats.num_tokens
        )
        assert max_diff(params, miscounted) > 100 * INDEPENDENT_TOLERANCE


def test_environment_rewards_reach_the_advantages_and_the_metrics(tiny_llama_path):
    """The environment's rewards are added to the reward function's before the advantages; the
    masked tokens and the agent metrics are logged (through RLMetrics' ``self.log``)."""
    _, module, _ = train(tiny_llama_path, steps=1, module_cls=TrajectoryModule)
    logged = {k: float(v) for k, v in module.trainer.callback_metrics.items()}
    for g in module.last_iteration.groups:
        environment = [0.0, 1.0, 0.0, 1.0]  # sample i: i % 2, sample 2: None
        assert g.reward_components["environment"] == environment
        lengths = [len(c) / 10.0 for c in g.completions]  # length_reward
        assert g.rewards == pytest.approx(
            [r + e for r, e in zip(lengths, environment, strict=True)]
        )
        assert g.truncated == [False, False, False, True]  # sample 3 stopped on "length"
    assert logged["rewards/environment"] == 0.5
    assert logged["rollout/masked_tokens"] == module.last_iteration.masked_tokens
    assert logged["agent/tool_calls"] == 1.0 and logged["agent/tool_errors"] == 0.5
    assert logged["agent/tool_latency_s"] == pytest.approx(0.625)
    assert logged["agent/stop/length"] == 0.25
    turns = [len(t.turns) for g in module.last_iteration.groups for t in g.trajectories]
    assert logged["agent/turns"] == pytest.approx(sum(turns) / len(turns))


def test_all_ones_masks_train_as_single_turn_groups(tiny_llama_path):
    """Two iterations: the same steps, bit for bit."""
    single = train(tiny_llama_path, module_cls=RecordingModule)
    ones = train(tiny_llama_path, module_cls=OnesTrajectoryModule)
    assert all(g.trajectories for g in ones[1].last_iteration.groups)
    assert_same_update(single, ones, "all-ones loss masks")


def test_packed_shared_prompt_forwards_equal_padded_ones_with_masks(tiny_llama_path):
    padded, module, _ = train(tiny_llama_path, module_cls=TrajectoryModule, shared_prompt=False)
    packed, other, _ = train(tiny_llama_path, module_cls=TrajectoryModule, shared_prompt=True)
    assert [r.loss["tokens"] for r in module.records] == [r.loss["tokens"] for r in other.records]
    assert module.records[0].loss["tokens"] < sum(
        len(c) for cs in module.records[0].completions.values() for c in cs
    )
    assert max_diff(padded, packed) <= ORDER_TOLERANCE


# ---- training: the mismatch metrics and the importance weights ------------------------------
class IdsOnlyHF(HFEngine):
    """An engine that gives no behaviour log-probs."""

    def generate(self, requests, sampling):
        return super().generate(requests, sampling)


def test_mismatch_and_importance_weights_ignore_environment_tokens(tiny_llama_path):
    """The environment tokens' behaviour log-probs are 0.0 (nothing sampled them): counted,
    they would show as a mismatch of several nats and pull the importance weights down. The HF
    engine samples with the trainer's numerics, so on model tokens there is none."""
    _, module, _ = train(tiny_llama_path, steps=1, module_cls=TrajectoryModule, tis_cap=2.0)
    stats = module.last_iteration
    metrics = stats.metrics()
    assert stats.loss["mismatch_tokens"] == model_tokens(stats.groups)
    assert metrics["mismatch/missing_tokens"] == 0
    assert metrics["mismatch/abs_logp"] < 1e-5
    assert metrics["mismatch/ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch/tis_weight"] == pytest.approx(1.0, abs=1e-4)


def test_missing_behaviour_counts_model_tokens_only(tiny_llama_path):
    strategy = {"engine": "test_loss_mask:IdsOnlyHF", "use_ray": False, "overlap": False}
    _, module, _ = train(tiny_llama_path, steps=1, module_cls=TrajectoryModule, strategy=strategy)
    stats = module.last_iteration
    mismatch = {k: v for k, v in stats.metrics().items() if k.startswith("mismatch/")}
    assert mismatch == {"mismatch/missing_tokens": model_tokens(stats.groups)}
    assert model_tokens(stats.groups) < stats.num_tokens


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_the_loss_has_exactly_zero_gradient_on_environment_tokens(loss_type):
    """The gradient of the loss with respect to the log-probs of environment tokens is exactly
    zero (with the KL term on, and advantages large), so nothing of a tool reply is trained."""
    from periodic_rl.algorithms.losses import loss_numerator, per_token_policy_loss

    masks = [[0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 1]]
    groups = [group(0, [[5] * 7, [6] * 7], masks)]
    mask = apply_loss_masks(torch.ones(2, 7), groups)
    logps = (-torch.rand(2, 7, dtype=torch.float64)).requires_grad_()
    per_token, _ = per_token_policy_loss(
        logps, logps.detach() - 0.1, torch.tensor([3.0, -2.0], dtype=torch.float64), mask,
        epsilon=0.2, epsilon_high=0.28, beta=0.5, ref_logps=logps.detach() + 0.3,
    )  # fmt: skip
    loss_numerator(per_token, mask, loss_type).backward()
    environment = mask == 0
    assert torch.count_nonzero(logps.grad[environment]) == 0
    assert torch.count_nonzero(logps.grad[~environment]) == int((~environment).sum())
