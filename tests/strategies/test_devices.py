"""The strategy trains on the Trainer's device (accelerator and devices), and only one."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from periodic_rl import PeriodicAsyncStrategy


@pytest.fixture
def one_fake_gpu(monkeypatch):
    """Lightning sees one CUDA device on this CPU machine (nothing is run on it)."""
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def trainer(**kwargs) -> L.Trainer:
    return L.Trainer(logger=False, enable_checkpointing=False, **kwargs)


def test_follows_the_gpu_accelerator(one_fake_gpu):
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    built = trainer(accelerator="gpu", devices=1, strategy=strategy)
    assert isinstance(built.accelerator, CUDAAccelerator)
    assert strategy.root_device == torch.device("cuda", 0)


def test_cpu_by_default_and_explicit_device_wins():
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    trainer(accelerator="cpu", strategy=strategy)
    assert strategy.root_device == torch.device("cpu")
    assert PeriodicAsyncStrategy(device="cuda:1").root_device == torch.device("cuda", 1)


def test_explicit_device_wins_over_the_accelerator(one_fake_gpu):
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False, device="cuda:0")
    trainer(accelerator="gpu", devices=1, strategy=strategy)
    assert strategy.root_device == torch.device("cuda", 0)


def test_several_devices_are_refused_naming_the_fix():
    strategy = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    with pytest.raises(ValueError, match=r"one device.*periodic_async_ddp.*devices=1"):
        trainer(accelerator="cpu", devices=2, strategy=strategy)


def test_cli_trains_on_one_device_by_default(capsys, monkeypatch):
    import sys

    from periodic_rl.cli import main

    monkeypatch.setattr(sys, "argv", ["periodic-rl"])
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    assert "  devices: 1\n" in capsys.readouterr().out
