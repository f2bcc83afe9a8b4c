"""Scoring multi-turn groups (:class:`~periodic_rl.scoring.Scorer` with
``GeneratedGroup.trajectories``): the rewards read each trajectory's ``messages``, the
environment's rewards are added as the component ``environment`` (also without any reward
function), truncation comes from why a trajectory stopped, the overlong penalty counts model
tokens, and the trajectories reach the scored group."""

from __future__ import annotations

import pytest

from periodic_rl.rewards import RewardError
from periodic_rl.rollout.types import GeneratedGroup, Trajectory, Turn
from periodic_rl.scoring import Scorer

IDS = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]]
MASKS = [[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 1, 1]]


class Decoder:
    """A tokenizer that decodes token ids as their numbers."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(t) for t in row) for row in ids]


def trajectories(rewards=(1.0, None, -0.5), stops=("done", "length", "token_budget")):
    return [
        Trajectory(
            loss_mask=mask,
            turns=(Turn(start=0, model_tokens=sum(mask)),),
            messages=[{"role": "assistant", "content": f"turn of {i}"}],
            env_reward=reward,
            stop=stop,
        )
        for i, (mask, reward, stop) in enumerate(zip(MASKS, rewards, stops, strict=True))
    ]


def generated(trajs) -> GeneratedGroup:
    return GeneratedGroup(
        index=0, completion_ids=IDS, version=0, fingerprint="f", worker=0, seed=1,
        trajectories=trajs,
    )  # fmt: skip


def scorer(*funcs, **kwargs) -> Scorer:
    return Scorer(
        tokenizer=Decoder(),
        reward_funcs=list(funcs),
        reward_weights=[2.0] * len(funcs),
        **kwargs,
    )


def test_rewards_read_messages_and_the_environment_reward_is_added():
    seen = {}

    def reads_messages(prompts, completions, **columns):
        seen.update(columns)
        return [float(len(c.split())) for c in completions]  # decoded: every token

    group = scorer(reads_messages).score(generated(trajectories()), {"prompt": "q", "a": 1}, [1])
    assert seen["messages"] == [t.messages for t in trajectories()] and seen["a"] == [1] * 3
    assert group.reward_components["reads_messages"] == [5.0, 3.0, 4.0]
    assert group.reward_components["environment"] == [1.0, 0.0, -0.5]  # None scores 0.0
    assert group.rewards == [2.0 * 5 + 1.0, 2.0 * 3, 2.0 * 4 - 0.5]
    assert group.trajectories == trajectories()
    assert group.loss_masks() == MASKS
    assert group.truncated == [False, True, True]  # "length" and "token_budget" stops
    assert "messages" not in group.columns  # the row's columns only


def test_an_environment_reward_alone_needs_no_reward_function():
    group = scorer().score(generated(trajectories()), {"prompt": "q"}, [1])
    assert group.rewards == [1.0, 0.0, -0.5]
    assert group.reward_components == {"environment": [1.0, 0.0, -0.5]}
    assert group.advantages[0] > group.advantages[1] > group.advantages[2]


def test_without_environment_rewards_there_is_no_environment_component():
    none = trajectories(rewards=(None, None, None))
    group = scorer(lambda p, c, **k: [1.0] * len(c)).score(generated(none), {"prompt": "q"}, [1])
    assert "environment" not in group.reward_components and group.rewards == [2.0] * 3


def test_single_turn_groups_score_as_before():
    group = scorer(lambda p, c, **k: [1.0] * len(c), max_new_tokens=4).score(
        generated([]), {"prompt": "q"}, [1]
    )
    assert group.trajectories == [] and group.loss_masks() is None
    assert group.truncated == [True, False, True]  # the length check: 5 and 4 tokens, no EOS


def test_overlong_penalty_counts_model_tokens():
    """``max_new_tokens`` 4, buffer 2: 3 model tokens each (5, 3 and 4 tokens in all, which
    would score -1.5, -0.5 and -1.0)."""
    group = scorer(overlong_buffer=2, max_new_tokens=4).score(
        generated(trajectories()), {"prompt": "q"}, [1]
    )
    assert group.reward_components["overlong"] == [-0.5, -0.5, -0.5]


def test_held_out_groups_get_no_truncation_flags():
    group = scorer().score(generated(trajectories()), {"prompt": "q"}, [1], held_out=True)
    assert group.truncated == [] and group.rewards == [1.0, 0.0, -0.5]


def test_clashes_and_bad_trajectories_are_refused():
    def environment(prompts, completions, **columns):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="named 'environment' clashes"):
        scorer(environment).score(generated(trajectories()), {"prompt": "q"}, [1])
    with pytest.raises(ValueError, match="column 'messages'"):
        scorer().score(generated(trajectories()), {"prompt": "q", "messages": []}, [1])
    with pytest.raises(ValueError, match="2 trajectories for 3 completions"):
        scorer().score(generated(trajectories()[:2]), {"prompt": "q"}, [1])
    with pytest.raises(RewardError, match="non-finite"):
        bad = trajectories(rewards=(float("nan"), 1.0, 1.0))
        scorer().score(generated(bad), {"prompt": "q"}, [1])
