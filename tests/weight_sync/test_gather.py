"""gathered_on_rank0: whole parameters swapped in on rank 0 for a push, put back afterwards.

FSDP2's gather is exercised by the 2-rank FSDP test (tests/strategies/test_distributed.py);
here a stand-in gather function (each parameter doubled) pins the swap itself.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from periodic_rl.weight_sync.export import policy_state_dict
from periodic_rl.weight_sync.gather import gathered_on_rank0, zero3_full_tensor


def tiny_tied_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


def doubled(module, name, param):
    return param.detach() * 2


def test_rank0_exports_the_gathered_weights_and_gets_its_own_back():
    model = tiny_tied_model()
    before = {k: v.clone() for k, v in policy_state_dict(model).items()}
    originals = [id(p) for p in model.parameters()]
    with gathered_on_rank0(model, doubled, rank=0):
        inside = policy_state_dict(model)
        # a tied weight is gathered once and both of its modules see the same whole copy
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sorted(inside) == sorted(before)
    for name, tensor in before.items():
        torch.testing.assert_close(inside[name], tensor * 2, rtol=0, atol=0)
    assert [id(p) for p in model.parameters()] == originals
    for name, tensor in policy_state_dict(model).items():
        assert torch.equal(tensor, before[name])


def test_other_ranks_take_part_but_keep_nothing():
    model = tiny_tied_model()
    calls = []

    def counting(module, name, param):
        calls.append(name)
        return param.detach() * 2

    before = policy_state_dict(model)
    with gathered_on_rank0(model, counting, rank=1):
        inside = policy_state_dict(model)
    assert len(calls) == len(list(model.parameters()))  # every gather (a collective) ran
    for name, tensor in before.items():
        assert torch.equal(inside[name], tensor)


def test_no_gather_is_a_no_op():
    model = tiny_tied_model()
    with gathered_on_rank0(model, None, rank=0) as same:
        assert same is model


def test_zero3_gather_skips_parameters_deepspeed_does_not_partition():
    """Without a ``ds_id`` (DeepSpeed's mark of a partitioned parameter) nothing is gathered,
    so this runs without DeepSpeed installed; the gather itself needs CUDA (benchmarks/gpu.sh)."""
    param = torch.nn.Parameter(torch.ones(2))
    assert zero3_full_tensor(torch.nn.Linear(1, 1), "weight", param) is None
