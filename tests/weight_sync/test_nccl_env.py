"""NCCL's bootstrap sockets stay on loopback for a local run, on both sides of the weight group
(``push_transport="broadcast"``): the environment every member sets before its NCCL group forms
(:func:`~periodic_rl.compat.torch_distributed.nccl_environment`, the same for the training
ranks), the trainer's own join as rank 0 applying it, and a value the user set kept. The CPU
tests stop at the NCCL backend's constructor; the GPU test forms a real NCCL group between two
GPUs and checks what listens."""

from __future__ import annotations

import multiprocessing
import os

import psutil
import pytest
import torch

from periodic_rl.compat.torch_distributed import (
    NCCL_INTERFACE,
    loopback_interface,
    nccl_environment,
)
from periodic_rl.weight_sync import broadcast
from periodic_rl.weight_sync.broadcast import BroadcastPlan, GroupAddress, StoreServer, WeightGroup

TIMEOUT_S = 30.0
LOOPBACK = loopback_interface()


def test_a_local_group_bootstraps_on_the_loopback_interface():
    assert LOOPBACK is not None
    assert nccl_environment("127.0.0.1", {}) == {NCCL_INTERFACE: LOOPBACK}
    assert nccl_environment("localhost", {}) == {NCCL_INTERFACE: LOOPBACK}


def test_the_users_interface_and_a_cluster_address_are_left_alone():
    assert nccl_environment("127.0.0.1", {NCCL_INTERFACE: "eth0"}) == {}
    assert nccl_environment("10.1.2.3", {}) == {}  # members elsewhere: NCCL picks what reaches
    assert nccl_environment("10.1.2.3", {NCCL_INTERFACE: "ib0"}) == {}


@pytest.fixture
def nccl_seen(monkeypatch):
    """The trainer's join over NCCL up to the backend's constructor, which records the
    ``NCCL_SOCKET_IFNAME`` it would have read (no NCCL on this machine)."""
    monkeypatch.setenv(NCCL_INTERFACE, "placeholder")  # restored (or removed) afterwards
    monkeypatch.delenv(NCCL_INTERFACE)
    seen: list[str | None] = []

    def constructor(store, rank, size, timeout):
        seen.append(os.environ.get(NCCL_INTERFACE))
        return object()

    monkeypatch.setattr(broadcast, "_nccl", constructor)
    server = StoreServer("127.0.0.1", timeout_s=TIMEOUT_S)
    address = GroupAddress(server.host, server.port, 2, 1, "nccl", TIMEOUT_S)

    def join() -> list[str | None]:
        WeightGroup.join(address, 0, "127.0.0.1", store=server.store)
        return seen

    yield join
    server.close()


def test_the_trainers_nccl_bootstrap_is_on_loopback(nccl_seen):
    assert nccl_seen() == [LOOPBACK]


def test_the_trainer_keeps_the_users_interface(nccl_seen, monkeypatch):
    monkeypatch.setenv(NCCL_INTERFACE, "ib0")
    assert nccl_seen() == ["ib0"]


# ---- on two GPUs ----------------------------------------------------------------------------
def _gpu_member(address: GroupAddress, plan: BroadcastPlan, results) -> None:
    torch.cuda.set_device(1)
    group = WeightGroup.join(address, 1, "127.0.0.1")
    received = group.receive(plan)
    torch.cuda.synchronize()
    listening = [
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN
    ]
    results.put((received["w"].cpu(), listening))
    group.close()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="an NCCL group needs one GPU per member: two CUDA devices",
)
def test_a_real_nccl_group_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv(NCCL_INTERFACE, "placeholder")
    monkeypatch.delenv(NCCL_INTERFACE)  # each side sets it itself
    sent = {"w": torch.arange(1000, dtype=torch.float32, device="cuda:0")}
    plan = BroadcastPlan.of(sent)
    server = StoreServer("127.0.0.1", timeout_s=TIMEOUT_S)
    address = GroupAddress(server.host, server.port, 2, 1, "nccl", TIMEOUT_S)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_gpu_member, args=(address, plan, results), daemon=True)
    process.start()
    try:
        torch.cuda.set_device(0)
        group = WeightGroup.join(address, 0, "127.0.0.1", store=server.store)
        group.send(plan, sent)
        received, theirs = results.get(timeout=TIMEOUT_S)
        assert torch.equal(received, sent["w"].cpu())
        ours = [
            c.laddr.ip
            for c in psutil.net_connections("tcp")
            if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN
        ]
        assert os.environ[NCCL_INTERFACE] == LOOPBACK
        assert ours and theirs, (ours, theirs)  # NCCL's bootstrap listens in both processes
        assert all(ip in ("127.0.0.1", "::1") for ip in ours + theirs), (ours, theirs)
        group.close()
    finally:
        process.join(TIMEOUT_S)
        if process.is_alive():
            process.kill()
        server.close()
