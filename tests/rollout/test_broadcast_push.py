"""``push_transport="broadcast"`` of RayRollouts on real Ray actors, over gloo on the CPU: the
same fingerprint and groups as an object-store push (HF engine with two workers, and the real
vLLM CPU engine); LoRA base and adapter pushes; a tampered load still fails the push; a worker
SIGKILLed between pushes is restarted, the push completes, and the next push forms a new group
and broadcasts again. The NCCL path into CUDA vLLM is the ``gpu`` test at the end."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from test_ray_rollouts import SAMPLING, by_index, make_jobs, ray_rollouts

from periodic_rl.weight_sync.fingerprint import weights_fingerprint

ray = pytest.importorskip("ray")


def scaled(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """New weights (tied names stay tied)."""
    out: dict[int, torch.Tensor] = {}
    return {n: out.setdefault(id(t), t * factor) for n, t in state.items()}


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_path):
    from periodic_rl.models import load_causal_lm

    return load_causal_lm(tiny_llama_path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def rollouts(tiny_llama_path):
    """Two HF workers pushed to by broadcast (``push_transport`` switched per push below)."""
    rollouts = ray_rollouts(tiny_llama_path, 2, push_transport="broadcast", groups_per_call=1)
    rollouts.broadcast_timeout_s = 20.0
    rollouts.start()
    yield rollouts
    rollouts.shutdown()


def held(rollouts) -> list[str]:
    """The fingerprint each worker reports now."""
    return ray.get([slot.actor.fingerprint.remote() for slot in rollouts._slots])


def push(rollouts, state, version, transport, **kwargs) -> str:
    rollouts.push_transport = transport
    try:
        return rollouts.push_weights(state, version, **kwargs)
    finally:
        rollouts.push_transport = "broadcast"


def test_broadcast_push_equals_object_store_push(rollouts, checkpoint, monkeypatch):
    monkeypatch.setenv("PERIODIC_RL_SHARED_WEIGHTS", "0")  # copied through the object store
    jobs = make_jobs(5)
    state = scaled(checkpoint, -1.5)
    expected = weights_fingerprint(state)
    assert push(rollouts, state, 1, "object_store") == expected
    by_store = by_index(rollouts.generate(jobs, SAMPLING, 1))
    assert rollouts.timings["last_push_transport"] == "object_store"

    assert push(rollouts, state, 2, "broadcast") == expected
    timings = rollouts.timings
    assert timings["last_push_transport"] == "broadcast" and timings["last_push_group_formed"]
    assert held(rollouts) == [expected] * 2
    groups = list(rollouts.generate(jobs, SAMPLING, 2))
    assert by_index(groups) == by_store and {g.worker for g in groups} == {0, 1}
    assert {g.fingerprint for g in groups} == {expected}

    # Back to the checkpoint: the group is kept, and the results are the checkpoint's again.
    generation = timings["last_push_group_generation"]
    assert push(rollouts, checkpoint, 3, "broadcast") == weights_fingerprint(checkpoint)
    assert not rollouts.timings["last_push_group_formed"]
    assert rollouts.timings["last_push_group_generation"] == generation
    assert by_index(rollouts.generate(jobs, SAMPLING, 3)) != by_store
    # bf16 weights into the fp32 engines: landed exactly (converted), fingerprint of what was sent
    half = {n: t.to(torch.bfloat16) for n, t in state.items()}
    assert push(rollouts, half, 4, "broadcast") == weights_fingerprint(half)


def test_lora_base_by_broadcast_then_adapter(rollouts, tiny_llama_path):
    from lora_helpers import peft_policy

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
        policy_state_dict,
    )
    from periodic_rl.weight_sync.fingerprint import adapter_fingerprint

    jobs = make_jobs(4)
    policy = peft_policy(tiny_llama_path)
    payload = lora_adapter_payload(policy)
    base = lora_base_state_dict(policy)
    base_fingerprint = push(rollouts, base, 10, "broadcast", keep=adapted_names(payload))
    assert rollouts.timings["last_push_transport"] == "broadcast"
    expected = adapter_fingerprint(base_fingerprint, payload)
    assert rollouts.push_adapter(payload, 11) == expected == rollouts.fingerprint
    merged = by_index(rollouts.generate(jobs, SAMPLING, 11))
    assert push(rollouts, policy_state_dict(policy), 12, "broadcast") == weights_fingerprint(
        policy_state_dict(policy)
    )
    assert by_index(rollouts.generate(jobs, SAMPLING, 12)) == merged


def test_killed_worker_is_restarted_and_the_group_reformed(rollouts, checkpoint):
    jobs = make_jobs(4)
    state = scaled(checkpoint, -2.0)
    expected = weights_fingerprint(state)
    push(rollouts, checkpoint, 20, "broadcast")
    generation = rollouts.timings["last_push_group_generation"]
    restarts = rollouts.restarts
    # Killed between pushes and restarted by a generate: the next push forms a new group.
    victim = rollouts.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)
    by_checkpoint = by_index(rollouts.generate(jobs, SAMPLING, 20))
    assert rollouts.restarts == restarts + 1 and victim not in rollouts.worker_pids()
    assert push(rollouts, state, 21, "broadcast") == expected
    timings = rollouts.timings
    assert timings["last_push_transport"] == "broadcast" and timings["last_push_group_formed"]
    assert timings["last_push_group_generation"] == generation + 1
    assert held(rollouts) == [expected] * 2
    by_broadcast = by_index(rollouts.generate(jobs, SAMPLING, 21))
    assert by_broadcast != by_checkpoint
    # Killed between pushes and found by the push: the broadcast fails, the push completes
    # through the object store (the dead worker restarted onto it), and the next push
    # broadcasts again through a new group.
    victim = rollouts.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    assert push(rollouts, state, 22, "broadcast") == expected
    assert rollouts.timings["last_push_transport"].startswith("object_store (broadcast failed")
    assert rollouts.restarts == restarts + 2 and victim not in rollouts.worker_pids()
    assert held(rollouts) == [expected] * 2
    assert push(rollouts, state, 23, "broadcast") == expected
    timings = rollouts.timings
    assert timings["last_push_transport"] == "broadcast" and timings["last_push_group_formed"]
    groups = list(rollouts.generate(jobs, SAMPLING, 23))
    assert by_index(groups) == by_broadcast and {g.worker for g in groups} == {0, 1}
    push(rollouts, checkpoint, 24, "broadcast")


def test_a_tampered_load_fails_the_broadcast_push(tiny_llama_path, checkpoint):
    tampering = ray_rollouts(
        tiny_llama_path, 1, kind="ray_fixtures:TamperingEngine", push_transport="broadcast"
    ).start()
    try:
        with pytest.raises(RuntimeError, match=r"worker 0 \(pid \d+\) reported"):
            tampering.push_weights(scaled(checkpoint, 2.0), version=1)
        assert tampering.timings.get("last_push_transport") is None  # no push succeeded
        with pytest.raises(RuntimeError, match="push"):
            tampering.generate(make_jobs(1), SAMPLING, version=1)
    finally:
        tampering.shutdown()


@pytest.mark.vllm
def test_vllm_broadcast_push_equals_object_store_push(vllm_tiny_path):
    from periodic_rl.models import load_causal_lm

    state = scaled(load_causal_lm(vllm_tiny_path, dtype=torch.float32).state_dict(), -1.5)
    expected = weights_fingerprint(state)
    jobs = make_jobs(4)
    vllm = ray_rollouts(
        vllm_tiny_path,
        1,
        kind="vllm",
        engine_kwargs={"max_model_len": 256, "kv_cache_gb": 0.1},
        push_transport="broadcast",
    ).start()
    try:
        assert push(vllm, state, 1, "object_store") == expected
        by_store = by_index(vllm.generate(jobs, SAMPLING, 1))
        assert push(vllm, state, 2, "broadcast") == expected
        assert vllm.timings["last_push_transport"] == "broadcast"
        groups = list(vllm.generate(jobs, SAMPLING, 2))
        assert by_index(groups) == by_store and {g.fingerprint for g in groups} == {expected}
    finally:
        vllm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: NCCL broadcast into CUDA vLLM"
)
def test_nccl_broadcast_into_cuda_vllm(vllm_tiny_path):
    """CUDA weights broadcast over NCCL into a CUDA vLLM worker on another GPU: the same
    fingerprint and groups as an object-store push, and the group kept for the next push. With
    one GPU the worker shares the trainer's, which one NCCL group cannot: that is detected
    when the group forms, and the pushes go through the object store, still verified."""
    from periodic_rl.models import load_causal_lm

    two = torch.cuda.device_count() >= 2
    model = load_causal_lm(vllm_tiny_path, dtype=torch.bfloat16).to("cuda:0")
    state = {n: t * -1.5 for n, t in model.state_dict().items()}
    expected = weights_fingerprint(state)
    jobs = make_jobs(4)
    kwargs = {"dtype": "bfloat16", "max_model_len": 256, "gpu_memory_utilization": 0.3}
    vllm = ray_rollouts(
        vllm_tiny_path,
        1,
        kind="vllm",
        engine_kwargs=kwargs,
        push_transport="broadcast",
        gpus_per_worker=1,
        local_gpus=[1] if two else [0],
    ).start()
    try:
        assert push(vllm, state, 1, "object_store") == expected
        by_store = by_index(vllm.generate(jobs, SAMPLING, 1))
        assert push(vllm, state, 2, "broadcast") == expected
        groups = list(vllm.generate(jobs, SAMPLING, 2))
        assert by_index(groups) == by_store and {g.fingerprint for g in groups} == {expected}
        assert push(vllm, state, 3, "broadcast") == expected
        if two:
            assert vllm.timings["last_push_transport"] == "broadcast"
            assert not vllm.timings["last_push_group_formed"]
            assert vllm._channel._group.address.backend == "nccl"
        else:
            assert "own GPU" in vllm._channel.unusable
            assert vllm.timings["last_push_transport"] == "object_store"
    finally:
        vllm.shutdown()
