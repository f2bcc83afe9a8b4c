"""Full pushes through shared memory (:mod:`periodic_rl.weight_sync.shared_memory`): the pushed
tensors' storages move into shared memory in place, a reader sees them (and the trainer's later
in-place updates) through mappings it keeps, and refuses what it cannot trust."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from periodic_rl.weight_sync.shared_memory import SharedWeightsReader, share


def model_state() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    model[1].weight = model[0].weight  # tied: one tensor under two names
    return model, {k: v.detach() for k, v in model.state_dict().items()}


def test_a_shared_push_moves_the_storages_in_place_and_reads_back_exactly():
    model, state = model_state()
    values = {k: v.clone() for k, v in state.items()}
    push = share(state)
    assert push is not None and all(p.is_shared() for p in model.parameters())
    assert push.tensors["0.weight"] == push.tensors["1.weight"]  # tied: the same place
    reader = SharedWeightsReader()
    got = reader.read(push)
    assert got.keys() == values.keys()
    assert all(torch.equal(got[k], values[k]) for k in values)
    assert got["0.weight"].data_ptr() == got["1.weight"].data_ptr()  # still tied
    with torch.no_grad():
        model[1].bias.add_(1.0)  # the trainer's next step, in place
    assert share(state) == push  # the same files: nothing moves again
    again = reader.read(push)
    assert torch.equal(again["1.bias"], values["1.bias"] + 1.0)
    assert len(reader._maps) == 2  # one mapping per storage (tied weight, bias), kept


def test_bfloat16_tensors_travel_as_they_are():
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    push = share({"w": tensor})
    assert torch.equal(SharedWeightsReader().read(push)["w"], tensor)


def test_what_cannot_travel_by_shared_memory_is_left_to_the_object_store():
    assert share({"w": torch.randn(4, 6).t()}) is None  # not contiguous
    assert share({"w": torch.randn(4, 6), "empty": torch.empty(0)}) is None


def test_a_reader_refuses_another_machines_push_and_a_replaced_file():
    _, state = model_state()
    push = share(state)
    elsewhere = dataclasses.replace(push, boot_id="another-machine")
    with pytest.raises(RuntimeError, match="another machine"):
        SharedWeightsReader().read(elsewhere)
    name, where = next(iter(push.tensors.items()))
    moved = dataclasses.replace(push, tensors={name: dataclasses.replace(where, inode=-1)})
    with pytest.raises(RuntimeError, match="no longer"):
        SharedWeightsReader().read(moved)


def test_more_storages_than_a_quarter_of_the_file_limit_stay_unshared(monkeypatch):
    import periodic_rl.weight_sync.shared_memory as shared_memory

    monkeypatch.setattr(shared_memory, "_max_files", lambda: 2)
    tensors = {f"w{i}": torch.randn(3) for i in range(3)}
    assert share(tensors) is None
    assert not any(t.is_shared() for t in tensors.values())  # nothing moved, no file opened
