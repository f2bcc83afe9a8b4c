"""The weight group of ``push_transport="broadcast"`` between two real processes over gloo:
tensors (fp32, bf16, int, 0-d, tied, several buckets) arrive bit for bit and tied names share
one tensor; nothing of either process listens beyond loopback; a member that dies makes the
other's broadcast fail at once (not at the timeout); a new generation forms over the same store;
torch's default process group is left alone."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from periodic_rl.weight_sync.broadcast import (
    BroadcastPlan,
    GroupAddress,
    StoreServer,
    WeightGroup,
)

TIMEOUT_S = 30.0


def state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 8, generator=generator).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.weight": torch.randn(8, 8, generator=generator),
        "model.layers.0.bias": torch.randn(3, generator=generator).to(torch.float16),
        "model.big": torch.randn(3000, generator=generator),  # a bucket of its own below
        "model.step": torch.tensor(7, dtype=torch.int64),  # 0-d
        "model.empty": torch.empty(0, 4),
        "lm_head.weight": embed,  # tied: travels once
    }


def member(address: GroupAddress, rank: int, plans, results, die_before_receive: bool) -> None:
    """A worker: join, then receive every plan it is given (or die before the first)."""
    group = WeightGroup.join(address, rank, "127.0.0.1")
    results.put(("joined", os.getpid()))
    while True:
        plan = plans.get(timeout=TIMEOUT_S)
        if plan is None:
            break
        if die_before_receive:
            os._exit(1)
        try:
            received = group.receive(plan)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results.put(("error", repr(error)))
            break
        tied = received["lm_head.weight"] is received["model.embed_tokens.weight"]
        results.put(("received", {n: t.clone() for n, t in received.items()}, tied))
    group.close()


def listening_sockets() -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every TCP socket this process or a child listens on."""
    me = psutil.Process()
    tree = {me.pid} | {p.pid for p in me.children(recursive=True)}
    return [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections("tcp")
        if c.pid in tree and c.status == psutil.CONN_LISTEN
    ]


class Member:
    """A member process of one generation."""

    def __init__(self, server: StoreServer, generation: int, die: bool = False) -> None:
        context = multiprocessing.get_context("spawn")
        self.plans, self.results = context.Queue(), context.Queue()
        self.address = GroupAddress(
            server.host, server.port, 2, generation, "gloo", timeout_s=TIMEOUT_S
        )
        self.process = context.Process(
            target=member, args=(self.address, 1, self.plans, self.results, die), daemon=True
        )
        self.process.start()
        self.group = WeightGroup.join(self.address, 0, "127.0.0.1", store=server.store)
        kind, self.pid = self.results.get(timeout=TIMEOUT_S)
        assert kind == "joined"

    def close(self) -> None:
        self.plans.put(None)
        self.group.close()
        self.process.join(TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def server():
    server = StoreServer("127.0.0.1", timeout_s=TIMEOUT_S)
    yield server
    server.close()


def test_plan_packs_buckets_and_ties():
    sent = state_dict()
    plan = BroadcastPlan.of(sent, bucket_bytes=4096)
    assert plan.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert sorted(plan.names) == sorted(sent)
    assert len(plan.buckets) == 3  # big alone between the small ones, then the rest
    for bucket in plan.buckets:
        for spec in bucket.tensors:
            assert spec.offset % 64 == 0 and spec.offset + spec.nbytes <= bucket.nbytes


def default_group():
    """The default process group, or ``None`` (another test's in-process vLLM engine may hold
    one for the whole session)."""
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def test_two_processes_exchange_tensors_on_loopback_only(server):
    before = default_group()
    sent = state_dict()
    peer = Member(server, generation=1)
    try:
        for bucket_bytes in (4096, 1 << 20):  # three buckets, then one
            plan = BroadcastPlan.of(sent, bucket_bytes=bucket_bytes)
            peer.plans.put(plan)
            peer.group.send(plan, sent)
            kind, received, tied = peer.results.get(timeout=TIMEOUT_S)
            assert kind == "received" and tied
            assert received.keys() == sent.keys()
            for name, tensor in sent.items():
                assert received[name].dtype == tensor.dtype, name
                assert torch.equal(received[name], tensor), name
        # The store and gloo's connections of both processes: loopback only.
        ours = listening_sockets()
        assert any(port == server.port for _, port, _ in ours)
        assert any(pid == peer.pid for _, _, pid in ours)  # gloo's in the member process
        assert all(ip in ("127.0.0.1", "::1") for ip, _, _ in ours), ours
        assert default_group() is before  # the default group was never touched
    finally:
        peer.close()


def test_a_dead_member_fails_the_broadcast_and_a_new_generation_forms(server):
    sent = state_dict()
    plan = BroadcastPlan.of(sent, bucket_bytes=4096)
    dying = Member(server, generation=2, die=True)
    try:
        dying.plans.put(plan)
        dying.process.join(TIMEOUT_S)  # it exits before receiving
        began = time.monotonic()
        with pytest.raises(RuntimeError):
            dying.group.send(plan, sent)
        assert time.monotonic() - began < TIMEOUT_S / 2  # the broken connection, not the timeout
    finally:
        dying.close()
    # The same store serves a new generation; the broken one is gone.
    peer = Member(server, generation=3)
    try:
        peer.plans.put(plan)
        peer.group.send(plan, sent)
        kind, received, _ = peer.results.get(timeout=TIMEOUT_S)
        assert kind == "received" and torch.equal(received["model.big"], sent["model.big"])
    finally:
        peer.close()
    with pytest.raises(queue.Empty):
        peer.results.get(timeout=0.1)  # no error reported on the way out


def test_sender_refuses_tensors_that_differ_from_the_plan(server):
    sent = state_dict()
    plan = BroadcastPlan.of(sent)
    group = WeightGroup.join(
        GroupAddress(server.host, server.port, 1, 99, "gloo", TIMEOUT_S),
        0,
        "127.0.0.1",
        store=server.store,
    )
    try:
        changed = dict(sent, **{"model.layers.0.weight": torch.zeros(4, 4)})
        with pytest.raises(ValueError, match="does not match the plan"):
            group.send(plan, changed)
        with pytest.raises(RuntimeError, match="does not receive"):
            group.receive(plan)
    finally:
        group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.send(plan, sent)
