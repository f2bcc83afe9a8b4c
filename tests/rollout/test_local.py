"""LocalRollouts (``use_ray=False``): pushes are verified like the Ray rollouts'."""

from __future__ import annotations

import pytest
from ray_fixtures import DroppingEngine

from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.rollout.local import LocalRollouts
from periodic_rl.rollout.types import GroupJob, SamplingConfig
from periodic_rl.weight_sync.fingerprint import weights_fingerprint


def test_verified_push_stamps_the_groups(tiny_llama_path, make_trainer):
    rollouts = LocalRollouts(HFEngine(tiny_llama_path))
    state = make_trainer(tiny_llama_path).state_dict()
    assert rollouts.push_weights(state, version=3) == weights_fingerprint(state)
    (group,) = rollouts.generate(
        [GroupJob(index=0, prompt_ids=[1, 5, 9], n=2, seed=0)], SamplingConfig(4), version=3
    )
    assert (group.version, group.fingerprint) == (3, weights_fingerprint(state))


def test_engine_that_loses_a_tensor_fails_the_push(tiny_llama_path, make_trainer):
    rollouts = LocalRollouts(DroppingEngine(tiny_llama_path))
    state = make_trainer(tiny_llama_path).state_dict()
    with pytest.raises(RuntimeError, match="other weights than the policy's"):
        rollouts.push_weights(state, version=1)
    assert rollouts.version == -1  # its groups stay stamped with no policy version
