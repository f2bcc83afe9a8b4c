"""End-to-end invariants of the RL iteration, on a tiny model with the in-process HF engine."""

import pytest
from rl_helpers import max_diff, train

from periodic_rl import RLModule


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_k_micro_batches_equal_one_batch(tiny_llama_path, loss_type):
    one, _, _ = train(tiny_llama_path, loss_type=loss_type, micro_batch_size=12)
    three, _, _ = train(tiny_llama_path, loss_type=loss_type, micro_batch_size=4)
    initial = RLModule(model=tiny_llama_path)
    initial.configure_model()
    moved = max_diff(one, dict(initial.policy.named_parameters()))
    assert moved > 1e-3  # training really changed the weights
    assert max_diff(one, three) < 1e-6
