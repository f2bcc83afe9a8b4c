"""Multi-turn training end to end (real Lightning Trainer, tiny model, the transformers engine):
the environment's turns reach the trainer as masked trajectories, and the core invariants hold
for trajectories as for completions: overlapped on Ray workers == synchronous in process, two
workers == one."""

from __future__ import annotations

from pathlib import Path

import pytest
from rl_helpers import assert_same_update, train

from periodic_rl import PromptDataModule
from periodic_rl.agents.config import AgentConfig

GAME = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "guess_number.jsonl")
AGENT = AgentConfig(environment="examples.guess_number:GuessNumber", max_turns=3, max_turn_tokens=4)


def game_data() -> PromptDataModule:
    return PromptDataModule(source=GAME, batch_size=2, num_train=8, num_val=0)


def run(tiny_llama_path, strategy=None, **kwargs):
    return train(
        tiny_llama_path,
        steps=2,
        strategy=strategy,
        data=game_data(),
        agent=AGENT,
        max_new_tokens=10,
        **kwargs,
    )


@pytest.fixture(scope="module")
def synchronous(tiny_llama_path):
    return run(tiny_llama_path)


def test_the_trained_groups_are_multi_turn_trajectories(synchronous):
    _, module, _ = synchronous
    groups = module.last_iteration.groups
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == sum(len(g.completion_ids) for g in groups) == 8
    assert max(len(t.turns) for t in trajectories) > 1
    for group in groups:
        for ids, trajectory in zip(group.completion_ids, group.trajectories, strict=True):
            assert len(trajectory.loss_mask) == len(ids)
            assert 0 < sum(trajectory.loss_mask) <= 10  # the model-token budget
            assert trajectory.loss_mask[0] == 0  # the generation prompt is the environment's
        assert "environment" in group.reward_components
    metrics = module.trainer.callback_metrics
    assert metrics["agent/turns"] > 1 and metrics["rollout/masked_tokens"] > 0
    assert 0.0 <= metrics["agent/engine_idle_share"] < 1.0


def test_overlapped_on_ray_equals_synchronous_in_process(synchronous, tiny_llama_path, local_ray):
    overlapped = run(tiny_llama_path, {"engine": "hf", "num_workers": 2, "overlap": True})
    assert_same_update(synchronous, overlapped, "multi-turn, overlapped on two Ray workers")
    order = [t.loss_mask for g in synchronous[1].last_iteration.groups for t in g.trajectories]
    other = [t.loss_mask for g in overlapped[1].last_iteration.groups for t in g.trajectories]
    assert sorted(map(tuple, order)) == sorted(map(tuple, other))


def test_a_cut_prompt_is_refused_before_generation(tiny_llama_path):
    with pytest.raises(ValueError, match="multi-turn rollouts cannot cut a prompt"):
        run(tiny_llama_path, max_prompt_length=8)
