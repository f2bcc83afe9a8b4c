"""Checkpoints written in the background (``AsyncAtomicCheckpointIO``, the strategies' default):
the file holds the state at the save however training goes on, a failed write surfaces naming
the file, teardown (the end of a fit) waits for the writes, removals never race them, and a
SIGKILL mid-write leaves the previous checkpoint loadable."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.checkpoint import (
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    CheckpointDiskFullError,
    CheckpointWriteError,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint import _disk_full_at, _fit  # noqa: E402


class HeldSave:
    """``torch.save`` that waits for :meth:`release` before writing (records what it started):
    a write is then certainly still in flight while the test goes on."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.save = torch.save

    def __call__(self, obj, handle, *args, **kwargs):
        self.started.set()
        assert self.go.wait(timeout=60), "never released"
        return self.save(obj, handle, *args, **kwargs)

    def release(self) -> None:
        self.go.set()


def _state():
    """A small model's state and its AdamW state after one step (tied weights, as SmolLM2's
    embedding and head are: two state-dict entries, one storage)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    model[1].weight = model[0].weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    return model, optimizer


def _checkpoint(model, optimizer, step):
    return {
        "global_step": step,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }


def _train_step(model, optimizer):
    model(torch.tensor([3, 4])).sum().backward()
    optimizer.step()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _clone(value):
    return copy.deepcopy(value)


def test_file_holds_the_state_at_the_save_while_training_goes_on(tmp_path, monkeypatch):
    model, optimizer = _state()
    io = AsyncAtomicCheckpointIO()
    held = HeldSave()
    monkeypatch.setattr(torch, "save", held)
    expected = _clone(_checkpoint(model, optimizer, 1))
    io.save_checkpoint(_checkpoint(model, optimizer, 1), tmp_path / "a.ckpt")  # returns at once
    assert held.started.wait(timeout=60)
    _train_step(model, optimizer)  # parameters and AdamW moments change in place
    with torch.no_grad():
        model[0].weight.mul_(-1.0)
    changed = _checkpoint(model, optimizer, 1)
    assert not _same(changed["state_dict"], expected["state_dict"])  # it did change
    held.release()
    io.wait()
    monkeypatch.undo()
    written = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert _same(written, expected)
    entries = written["state_dict"]  # the tie survives: one storage, as torch.save keeps it
    assert entries["0.weight"].untyped_storage().data_ptr() == (
        entries["1.weight"].untyped_storage().data_ptr()
    )
    io.teardown()


def test_a_second_save_of_the_same_state_shares_the_snapshot(tmp_path, monkeypatch):
    """``ModelCheckpoint``'s top-k file, then ``last.ckpt``: the second save neither waits
    for the first write nor copies again; a save after a change waits and copies."""
    model, optimizer = _state()
    io = AsyncAtomicCheckpointIO()
    held = HeldSave()
    monkeypatch.setattr(torch, "save", held)
    first = _clone(_checkpoint(model, optimizer, 1))
    io.save_checkpoint(_checkpoint(model, optimizer, 1), tmp_path / "step=1.ckpt")
    io.save_checkpoint(_checkpoint(model, optimizer, 1), tmp_path / "last.ckpt")  # no wait
    assert len(io._pending) == 2 and not (tmp_path / "last.ckpt").exists()
    _train_step(model, optimizer)
    second = _clone(_checkpoint(model, optimizer, 2))
    threading.Timer(0.5, held.release).start()
    io.save_checkpoint(_checkpoint(model, optimizer, 2), tmp_path / "step=2.ckpt")  # waits
    assert held.go.is_set()  # it could only go on once the earlier writes went through
    io.teardown()
    monkeypatch.undo()
    for name, state in (("step=1", first), ("last", first), ("step=2", second)):
        assert _same(torch.load(tmp_path / f"{name}.ckpt", weights_only=True), state), name


def _dumped(model, optimizer, step, last_path=""):
    """What Lightning's dump gives: the state, a fresh RNG-state tensor each time, and the
    checkpoint callback's own (non-tensor) state."""
    return {
        **_checkpoint(model, optimizer, step),
        "rng": torch.get_rng_state(),
        "callbacks": {"ModelCheckpoint": {"last_model_path": last_path}},
    }


def test_modelcheckpoint_order_shares_the_snapshot_and_links_the_file(tmp_path, monkeypatch):
    """What ``ModelCheckpoint`` does: the new top-k file, the removal of the old one, then
    ``last.ckpt``. The removal queued between the saves, and the fresh RNG-state tensor of
    each dump, must not make ``last.ckpt`` wait for the first write (they did: a 5 s stall per
    checkpoint of the demo); ``last.ckpt`` of the same values is the same file on disk (a hard
    link), not a second write of the same bytes."""
    model, optimizer = _state()
    io = AsyncAtomicCheckpointIO()
    io.save_checkpoint(_dumped(model, optimizer, 0), tmp_path / "step=0.ckpt")
    io.wait()
    held = HeldSave()
    monkeypatch.setattr(torch, "save", held)
    state = _clone(_dumped(model, optimizer, 1))
    io.save_checkpoint(_dumped(model, optimizer, 1), tmp_path / "step=1.ckpt")
    io.remove_checkpoint(tmp_path / "step=0.ckpt")
    io.save_checkpoint(_dumped(model, optimizer, 1), tmp_path / "last.ckpt")  # no wait
    assert not held.go.is_set() and len(io._pending) == 3
    held.release()
    io.teardown()
    monkeypatch.undo()
    assert not (tmp_path / "step=0.ckpt").exists()
    assert os.path.samefile(tmp_path / "last.ckpt", tmp_path / "step=1.ckpt")
    assert _same(torch.load(tmp_path / "last.ckpt", weights_only=True), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=1.ckpt"]


def test_a_second_save_with_other_plain_values_is_its_own_file(tmp_path):
    model, optimizer = _state()
    io = AsyncAtomicCheckpointIO()
    io.save_checkpoint(_dumped(model, optimizer, 1), tmp_path / "step=1.ckpt")
    io.save_checkpoint(_dumped(model, optimizer, 1, "last.ckpt"), tmp_path / "last.ckpt")
    io.teardown()
    assert not os.path.samefile(tmp_path / "last.ckpt", tmp_path / "step=1.ckpt")
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["callbacks"]["ModelCheckpoint"]["last_model_path"] == "last.ckpt"
    assert _same(last["state_dict"], model.state_dict())


def test_where_links_fail_the_second_file_is_written_in_full(tmp_path, monkeypatch):
    def no_links(*args):
        raise OSError("hard links not supported here")

    model, optimizer = _state()
    io = AsyncAtomicCheckpointIO()
    monkeypatch.setattr(os, "link", no_links)
    io.save_checkpoint(_checkpoint(model, optimizer, 1), tmp_path / "step=1.ckpt")
    io.save_checkpoint(_checkpoint(model, optimizer, 1), tmp_path / "last.ckpt")
    io.teardown()
    assert not os.path.samefile(tmp_path / "last.ckpt", tmp_path / "step=1.ckpt")
    loaded = [torch.load(tmp_path / n, weights_only=True) for n in ("step=1.ckpt", "last.ckpt")]
    assert _same(loaded[0], loaded[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=1.ckpt"]


def test_removal_waits_for_the_write_without_stalling(tmp_path, monkeypatch):
    io = AsyncAtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, tmp_path / "step=1.ckpt")
    io.wait()
    held = HeldSave()
    monkeypatch.setattr(torch, "save", held)
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, tmp_path / "step=2.ckpt")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")  # queued behind the write: returns at once
    assert (tmp_path / "step=1.ckpt").exists()
    held.release()
    io.teardown()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]


def _failing_save(bad: str):
    save = torch.save

    def fake(obj, handle, *args, **kwargs):
        if obj["name"] == bad:
            handle.write(b"partial bytes")
            raise RuntimeError("the serialiser broke")
        return save(obj, handle, *args, **kwargs)

    return fake


def test_a_failed_background_write_surfaces_at_the_next_save(tmp_path, monkeypatch):
    io = AsyncAtomicCheckpointIO()
    io.save_checkpoint({"name": "a", "w": torch.ones(3)}, tmp_path / "a.ckpt")
    monkeypatch.setattr(torch, "save", _failing_save("b"))
    io.save_checkpoint({"name": "b", "w": torch.zeros(3)}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # skipped: the write before it failed
    with pytest.raises(CheckpointWriteError, match=r"b\.ckpt") as raised:
        io.save_checkpoint({"name": "c", "w": torch.zeros(3)}, tmp_path / "c.ckpt")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]  # no partial, no temp
    io.save_checkpoint({"name": "c", "w": torch.zeros(3)}, tmp_path / "c.ckpt")  # reported once
    io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "c.ckpt"]


def test_a_failed_background_write_surfaces_at_teardown(tmp_path, monkeypatch):
    io = AsyncAtomicCheckpointIO()
    monkeypatch.setattr(torch, "save", _disk_full_at(7))
    io.save_checkpoint({"global_step": 7, "w": torch.ones(3)}, tmp_path / "step=7.ckpt")
    with pytest.raises(CheckpointDiskFullError, match=r"no space left .*step=7\.ckpt"):
        io.teardown()
    assert list(tmp_path.iterdir()) == []


def test_teardown_waits_for_the_write(tmp_path, monkeypatch):
    io = AsyncAtomicCheckpointIO()
    held = HeldSave()
    monkeypatch.setattr(torch, "save", held)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, tmp_path / "last.ckpt")
    threading.Timer(0.5, held.release).start()
    io.teardown()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1


def test_fit_returns_once_its_checkpoints_are_on_disk(tiny_llama_path, tmp_path, monkeypatch):
    """Every write takes a while: when ``fit`` returns, the last step's checkpoint is there."""
    save = torch.save

    def slow(obj, handle, *args, **kwargs):
        time.sleep(0.5)
        return save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow)
    _, trainer = _fit(tiny_llama_path, tmp_path, 2)
    monkeypatch.undo()
    assert isinstance(trainer.strategy.checkpoint_io, AsyncAtomicCheckpointIO)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ]


def test_the_strategy_option():
    def io(**kwargs):
        strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False, **kwargs)
        return strategy.checkpoint_io

    assert isinstance(io(), AsyncAtomicCheckpointIO)
    off = io(async_checkpoints=False)
    assert isinstance(off, AtomicCheckpointIO) and not isinstance(off, AsyncAtomicCheckpointIO)
    pickle.dumps(io())  # a strategy may be pickled (spawned processes)


KILLED_WRITER = """
import os, sys, time, torch
from periodic_rl.checkpoint import AsyncAtomicCheckpointIO
path = sys.argv[1]
io = AsyncAtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, path)
io.wait()
save = torch.save
def slow(obj, handle, *args, **kwargs):
    handle.write(b"the first bytes of step 2")
    handle.flush()
    open(path + ".writing", "w").close()
    time.sleep(300)
torch.save = slow
io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path)
time.sleep(300)
"""


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    run = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)])
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{path}.writing").exists():
            assert run.poll() is None and time.monotonic() < deadline, "no write in flight"
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert AtomicCheckpointIO().load_checkpoint(path)["global_step"] == 1
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".last.ckpt.tmp-" + str(run.pid), "last.ckpt", "last.ckpt.writing"]
