"""What a local run exposes to the network: every listening socket of the driver's process tree
(Ray's GCS, raylet, object manager, workers and agents, the rollout workers and their vLLM
engines) is bound to a loopback address, after start-up and again mid-generation and after a
weight push; and an address the user asks for is used."""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest
import torch
from test_ray_rollouts import ray_rollouts

from periodic_rl.rollout.types import GroupJob, SamplingConfig

ray = pytest.importorskip("ray")


def listening_sockets() -> list[tuple[str, int, str]]:
    """``(address, port, process name)`` of each TCP/UDP socket that this process or one of its
    descendants listens on (UDP: every bound socket)."""
    me = psutil.Process()
    tree = {me.pid: me} | {p.pid: p for p in me.children(recursive=True)}
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.pid not in tree or not conn.laddr:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        try:
            name = tree[conn.pid].name()
        except psutil.NoSuchProcess:
            continue
        found.append((conn.laddr.ip, conn.laddr.port, name))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def exposed() -> list[tuple[str, int, str]]:
    sockets = listening_sockets()
    assert sockets, "no listening socket found: the check would prove nothing"
    return [s for s in sockets if not is_loopback(s[0])]


@pytest.mark.parametrize(
    "kind",
    ["hf", pytest.param("vllm", marks=pytest.mark.vllm)],
)
def test_a_local_run_listens_on_loopback_only(kind, tiny_llama_path, vllm_tiny_path):
    """A RayRollouts that starts its own Ray (as the strategies do): nothing of its process
    tree listens beyond loopback after start-up, mid-generation, and after a weight push."""
    from periodic_rl.models import load_causal_lm

    assert not ray.is_initialized()
    path = vllm_tiny_path if kind == "vllm" else tiny_llama_path
    engine_kwargs = {"max_model_len": 256, "kv_cache_gb": 0.1} if kind == "vllm" else {}
    rollouts = ray_rollouts(path, 1, kind=kind, engine_kwargs=engine_kwargs).start()
    try:
        assert exposed() == []
        # No dashboard (its packages are not installed here, so ask for it to stay off).
        assert rollouts._ray_init_args()["include_dashboard"] is False
        jobs = [GroupJob(i, [1, 504, 3016, 28 + i], n=2, seed=i) for i in range(3)]
        stream = rollouts.generate(jobs, SamplingConfig(max_new_tokens=8), version=0)
        next(stream)
        assert exposed() == []  # mid-generation: the engine has served a call
        list(stream)
        model = load_causal_lm(path, dtype=torch.float32)
        rollouts.push_weights(model.state_dict(), version=1)
        assert exposed() == []
    finally:
        rollouts.shutdown()


def routable_address() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family.name == "AF_INET" and not is_loopback(address.address):
                return address.address
    return None


def test_an_address_the_user_gives_is_used(tiny_llama_path):
    """``_node_ip_address`` in ``ray_init_kwargs`` is the user's choice: the loopback default
    steps aside, and Ray's switch is left as it was found."""
    from ray._private import ray_constants

    address = routable_address()
    if address is None:
        pytest.skip("this machine has no address other than loopback")
    rollouts = ray_rollouts(
        tiny_llama_path, 1, ray_init_kwargs={"num_cpus": 2, "_node_ip_address": address}
    ).start()
    try:
        assert ray.util.get_node_ip_address() == address
        assert any(ip in (address, "0.0.0.0", "::") for ip, _, _ in listening_sockets())
    finally:
        rollouts.shutdown()
    assert ray_constants.ENABLE_RAY_CLUSTER
