"""End-to-end invariants of the RL iteration, on a tiny model with the in-process HF engine."""

import pytest
from rl_helpers import ORDER_TOLERANCE, max_diff, train

from periodic_rl import RLModule


@pytest.mark.parametrize(
    ("loss_type", "shared_prompt"),
    [
        *[(loss_type, False) for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")],
        # packed forwards (the default): a sequence-level and a token-level normaliser
        ("grpo", True),
        ("dapo", True),
    ],
    ids=lambda value: value if isinstance(value, str) else ("packed" if value else "padded"),
)
def test_k_micro_batches_equal_one_batch(tiny_llama_path, loss_type, shared_prompt):
    kwargs = dict(loss_type=loss_type, shared_prompt=shared_prompt)
    one, _, _ = train(tiny_llama_path, micro_batch_size=12, **kwargs)
    three, _, _ = train(tiny_llama_path, micro_batch_size=4, **kwargs)
    initial = RLModule(model=tiny_llama_path)
    initial.configure_model()
    moved = max_diff(one, dict(initial.policy.named_parameters()))
    assert moved > 1e-3  # training really changed the weights
    assert max_diff(one, three) <= ORDER_TOLERANCE
