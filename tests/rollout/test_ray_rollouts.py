"""RayRollouts on a local Ray with tiny HF engines: every job once, worker-count invariance,
verified weight pushes, worker death mid-iteration, and no processes left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from periodic_rl.rollout.processes import alive, descendants, shm_files
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.types import GroupJob, SamplingConfig
from periodic_rl.weight_sync.fingerprint import weights_fingerprint

ray = pytest.importorskip("ray")

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLING = SamplingConfig(max_new_tokens=8, temperature=1.0)
# Ray is started with 2 logical CPUs; half a CPU per worker lets a few RayRollouts share it.
CPUS = 0.5


def make_jobs(count: int = 7) -> list[GroupJob]:
    return [
        GroupJob(index=i, prompt_ids=[1, 504, 3016, 28 + 3 * i][: 2 + i % 3], n=1 + i % 3, seed=i)
        for i in range(count)
    ]


def by_index(groups) -> dict[int, list[list[int]]]:
    return {g.index: g.completion_ids for g in groups}


def ray_rollouts(path: str, num_workers: int = 1, kind: str = "hf", **kwargs):
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    spec_kwargs = kwargs.pop("engine_kwargs", {})
    kwargs.setdefault("ray_init_kwargs", {"num_cpus": 2})
    return RayRollouts(
        EngineSpec(kind, path, spec_kwargs),
        num_workers,
        cpus_per_worker=CPUS,
        pythonpath=[HERE],
        **kwargs,
    )


def gone(pids) -> bool:
    """Whether none of ``pids`` is a live (non-zombie) process any more (waits up to 10 s)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if not any(alive(pid, None) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def gate_dir(tmp_path_factory):
    """Where a test puts ``hold-<pid>`` to make that worker's calls wait (``GatedEngine``)."""
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def rollouts2(tiny_llama_path, gate_dir):
    """Two workers, one group per call, engines that a test can hold (``GatedEngine``).
    Loaded by ``module:Class`` path from this directory (the rollouts' ``pythonpath``)."""
    rollouts = ray_rollouts(
        tiny_llama_path,
        2,
        kind="ray_fixtures:GatedEngine",
        engine_kwargs={"gate_dir": str(gate_dir)},
        groups_per_call=1,
    ).start()
    yield rollouts
    rollouts.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """The same engine in this process: what every RayRollouts must reproduce."""
    from periodic_rl.rollout.engines.hf_engine import HFEngine

    return HFEngine(tiny_llama_path)


def reference_groups(engine, jobs) -> dict[int, list[list[int]]]:
    return {j.index: engine.generate([j.request()], SAMPLING)[0] for j in jobs}


def test_every_job_once_stamped_and_equal_to_in_process(rollouts2, reference):
    jobs = make_jobs()
    groups = list(rollouts2.generate(jobs, SAMPLING, version=0))
    assert sorted(g.index for g in groups) == [j.index for j in jobs]
    assert by_index(groups) == reference_groups(reference, jobs)
    assert {g.worker for g in groups} == {0, 1}  # both workers took work
    assert all(g.fingerprint == rollouts2.fingerprint for g in groups)
    assert all(g.started <= g.finished and g.seed == g.index for g in groups)
    assert rollouts2.fingerprint == reference.fingerprint()
    lanes = {s.lane for s in rollouts2.spans.spans() if s.name == "generate"}
    assert lanes == {"worker-0", "worker-1"}
    assert rollouts2.timings["ray_init_s"] >= 0 and len(rollouts2.timings["worker_startup_s"]) == 2


def test_one_worker_matches_two_then_leaves_no_processes(rollouts2, tiny_llama_path):
    jobs = make_jobs()
    two = by_index(rollouts2.generate(jobs, SAMPLING, version=rollouts2.version or 0))
    one = ray_rollouts(tiny_llama_path, 1, groups_per_call=3, worker_cores=[[1]]).start()
    try:
        info = one.worker_info()[0]
        assert info["affinity"] == [1] and info["threads"] == 1  # pinned as asked
        assert by_index(one.generate(jobs, SAMPLING, version=0)) == two
        pids = one.worker_pids()
    finally:
        one.shutdown()
    assert gone(pids)
    one.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        one.generate(jobs, SAMPLING, 0)
    assert ray.is_initialized()  # the shared Ray (not started by `one`) is still up


def test_weight_push_is_verified_and_changes_results(rollouts2, reference, tiny_llama_path):
    from periodic_rl.models import load_causal_lm

    jobs = make_jobs(4)
    before = by_index(rollouts2.generate(jobs, SAMPLING, version=rollouts2.version or 0))
    model = load_causal_lm(tiny_llama_path, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-2.0)
    state = model.state_dict()
    assert rollouts2.push_weights(state, version=1) == weights_fingerprint(state)
    assert rollouts2.version == 1 and rollouts2.fingerprint == weights_fingerprint(state)
    groups = list(rollouts2.generate(jobs, SAMPLING, version=1))
    assert all(g.version == 1 and g.fingerprint == weights_fingerprint(state) for g in groups)
    reference.load_weights(state)
    assert by_index(groups) == reference_groups(reference, jobs) != before
    with pytest.raises(ValueError, match="version"):
        rollouts2.generate(jobs, SAMPLING, version=0)
    timings = rollouts2.timings
    assert timings["last_push_s"] > 0
    # The trainer hashes what it sent after the put, while the workers load.
    assert timings["last_push_put_s"] <= timings["last_push_hash_done_s"] <= timings["last_push_s"]
    loads = rollouts2.worker_load_timings()
    assert len(loads) == 2 and all(0 < load["load_s"] <= timings["last_push_s"] for load in loads)
    assert any(s.name == "weight push" for s in rollouts2.spans.spans())
    # Back to the original weights (as a new version) for the other tests.
    rollouts2.push_weights(original, version=2)
    reference.load_weights(original)
    assert by_index(rollouts2.generate(jobs, SAMPLING, version=2)) == before


@pytest.mark.parametrize(
    "kind",
    # a value changed before the load; a tensor received but not copied into the model
    ["ray_fixtures:TamperingEngine", "ray_fixtures:DroppingEngine"],
    ids=["tampered", "dropped"],
)
def test_fingerprint_mismatch_raises(tiny_llama_path, kind):
    from periodic_rl.models import load_causal_lm

    checkpoint = load_causal_lm(tiny_llama_path, dtype=torch.float32).state_dict()
    state = {name: tensor + 0.01 for name, tensor in checkpoint.items()}  # new weights
    rollouts = ray_rollouts(tiny_llama_path, 1, kind=kind).start()
    try:
        with pytest.raises(RuntimeError, match=r"worker 0 \(pid \d+\) reported"):
            rollouts.push_weights(state, version=1)
        with pytest.raises(RuntimeError, match="push"):
            rollouts.generate(make_jobs(1), SAMPLING, version=1)
    finally:
        rollouts.shutdown()


def test_a_full_push_reaches_local_workers_through_shared_memory_and_restarts_outlive_it(
    rollouts2, reference, tiny_llama_path
):
    """Workers on this machine read a full push in the trainer's memory (the tensors' storages
    move into shared memory, in place: the model trains there); the copy restarted workers
    load is put in the object store after the push. A worker killed after the trainer changed
    those tensors (past ``weights_will_change``, as an optimizer step is) comes back with the
    pushed weights, not the changed ones."""
    from periodic_rl.models import load_causal_lm

    jobs = make_jobs(4)
    model = load_causal_lm(tiny_llama_path, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    state = model.state_dict()
    version = (rollouts2.version or 0) + 1
    expected = rollouts2.push_weights(state, version)
    assert rollouts2.timings["last_push_transport"] == "shared_memory"
    assert all(param.is_shared() for param in model.parameters())
    reference.load_weights(state)
    pushed = reference_groups(reference, jobs)
    assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == pushed
    rollouts2.weights_will_change()  # the strategy's call before an optimizer step
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # the step, in the memory the workers read the push from
    os.kill(rollouts2.worker_pids()[0], signal.SIGKILL)
    assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == pushed
    assert rollouts2.worker_info()[0]["fingerprint"] == expected
    rollouts2.push_weights(original, version + 1)  # back to the checkpoint for the other tests
    reference.load_weights(original)


def test_adapter_pushes_are_verified_and_replayed_to_a_restarted_worker(rollouts2, reference):
    from lora_helpers import peft_policy

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
        payload_bytes,
        policy_state_dict,
    )
    from periodic_rl.weight_sync.fingerprint import adapter_fingerprint

    jobs = make_jobs(6)
    version = (rollouts2.version or 0) + 1
    policy = peft_policy(reference.model_path)
    payload = lora_adapter_payload(policy)
    base = lora_base_state_dict(policy)  # the checkpoint's: other tests see the same weights
    base_fingerprint = rollouts2.push_weights(base, version, keep=adapted_names(payload))
    expected = adapter_fingerprint(base_fingerprint, payload)
    assert rollouts2.push_adapter(payload, version + 1) == expected == rollouts2.fingerprint
    assert payload_bytes(payload) < payload_bytes(base) / 100
    reference.load_weights(policy_state_dict(policy))
    merged = reference_groups(reference, jobs)
    groups = list(rollouts2.generate(jobs, SAMPLING, version + 1))
    assert by_index(groups) == merged and {g.fingerprint for g in groups} == {expected}
    kinds = [s.args.get("kind") for s in rollouts2.spans.spans() if s.name == "weight push"]
    assert kinds[-2:] == ["base", "adapter"]
    # A worker killed now comes back with the base and the adapter (fingerprint checked).
    os.kill(rollouts2.worker_pids()[0], signal.SIGKILL)
    after = list(rollouts2.generate(jobs, SAMPLING, version + 1))
    assert by_index(after) == merged and {g.fingerprint for g in after} == {expected}
    assert rollouts2.worker_info()[0]["fingerprint"] == expected
    rollouts2.push_weights(base, version + 2)  # back to plain pushes for the other tests
    reference.load_weights(base)


def test_adapter_push_mismatch_raises(tiny_llama_path):
    from lora_helpers import peft_policy

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
    )

    policy = peft_policy(tiny_llama_path)
    payload = lora_adapter_payload(policy)
    kind, kwargs = "ray_fixtures:TamperingEngine", {"only_partial": True}
    rollouts = ray_rollouts(tiny_llama_path, 1, kind=kind, engine_kwargs=kwargs).start()
    try:
        with pytest.raises(RuntimeError, match="keep="):  # no base with keep pushed yet
            rollouts.push_adapter(payload, version=1)
        rollouts.push_weights(lora_base_state_dict(policy), 1, keep=adapted_names(payload))
        with pytest.raises(RuntimeError, match="loaded other weights"):
            rollouts.push_adapter(payload, version=2)
        with pytest.raises(RuntimeError, match="push"):
            rollouts.generate(make_jobs(1), SAMPLING, version=2)
    finally:
        rollouts.shutdown()


def test_worker_killed_mid_iteration_loses_and_repeats_nothing(rollouts2, gate_dir):
    jobs = make_jobs(10)
    version = rollouts2.version or 0
    clean = by_index(rollouts2.generate(jobs, SAMPLING, version))
    victim = rollouts2.worker_pids()[0]
    restarts, resent = rollouts2.restarts, rollouts2.redispatched_calls
    hold = gate_dir / f"hold-{victim}"
    hold.touch()  # worker 0's calls wait: it certainly still has them when it is killed
    seen = []
    try:
        for group in rollouts2.generate(jobs, SAMPLING, version):
            if not seen:
                assert group.worker == 1  # worker 0 was held
                os.kill(victim, signal.SIGKILL)
            seen.append(group)
    finally:
        hold.unlink(missing_ok=True)
    assert sorted(g.index for g in seen) == [j.index for j in jobs]  # each exactly once
    assert by_index(seen) == clean
    # Every call worker 0 held (as many as a worker may queue) was sent again, and worker 0
    # was replaced during the generation, not at some later push.
    assert rollouts2.redispatched_calls == resent + rollouts2.max_calls_in_flight
    assert rollouts2.restarts == restarts + 1
    assert rollouts2.worker_pids()[0] != victim and gone([victim])
    # The replacement holds the current weights and keeps working.
    after = list(rollouts2.generate(jobs, SAMPLING, version))
    assert by_index(after) == clean and {g.worker for g in after} == {0, 1}
    assert all(g.fingerprint == rollouts2.fingerprint for g in after)


DRIVER = textwrap.dedent(
    """
    import signal, sys, time
    # A driver started in the background of a non-interactive shell (nohup, CI runners) inherits
    # SIGINT as ignored; an interactive user's driver has Python's handler. Restore it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from periodic_rl.rollout.workers.rollouts import RayRollouts
    from periodic_rl.rollout.spec import EngineSpec
    from periodic_rl.rollout.types import GroupJob, SamplingConfig

    rollouts = RayRollouts(EngineSpec("hf", sys.argv[1]), 1, ray_init_kwargs={"num_cpus": 1})
    rollouts.start()
    print("pids", *rollouts.worker_pids(), flush=True)
    jobs = [GroupJob(i, [1, 504, 3016], 2, i) for i in range(4)]
    while True:
        list(rollouts.generate(jobs, SamplingConfig(max_new_tokens=4), 0))
        time.sleep(0.01)
    """
)


def test_ctrl_c_in_the_driver_leaves_no_processes(tiny_llama_path, tmp_path):
    """A driver that owns its Ray is interrupted mid-generation: every process it started
    (Ray's and the workers') must be gone once it has exited."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, RAY_ADDRESS="")
    driver = subprocess.Popen(
        [sys.executable, str(script), tiny_llama_path], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("pids"), line
        worker_pids = [int(p) for p in line.split()[1:]]
        time.sleep(0.5)
        family = [pid for pid, _ in descendants(driver.pid)]
        assert set(worker_pids) <= set(family)  # Ray's processes are the driver's children
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert gone(family)


@pytest.mark.vllm
@pytest.mark.pretrained
def threads_within(pid: int, cores: list[int]) -> dict[int, set[int]]:
    """The threads of process ``pid`` pinned within ``cores``, with their cores."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            affinity = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
        if affinity <= set(cores):
            found[int(tid)] = affinity
    return found


def moved_in_place(rollouts, info, jobs, sampling) -> float:
    """Move the one worker from core 1 to every core and back (``RayRollouts.repin``): the same
    process and weights each time, every thread it ran on its old cores (vLLM pinned its
    OpenMP threads one core each) on the new ones, as many torch threads, and it still
    generates. Returns the seconds both moves took."""
    everywhere = sorted(os.sched_getaffinity(0))
    began, old = time.time(), [1]
    for cores in (everywhere, [1]):
        on_old = threads_within(info["pid"], old)
        assert on_old
        rollouts.repin([cores])
        after = rollouts.worker_info()[0]
        assert (after["pid"], after["fingerprint"]) == (info["pid"], rollouts.fingerprint)
        assert after["affinity"] == cores and after["threads"] == len(cores)
        now = threads_within(info["pid"], cores)
        assert all(now.get(tid, set(cores)) == set(cores) for tid in on_old)
        assert len(list(rollouts.generate(jobs, sampling, version=1))) == len(jobs)
        old = cores
    assert rollouts.restarts == 0
    return time.time() - began


def test_vllm_worker_on_smollm2(smollm2_path):
    """One vLLM worker pinned to one core: a 135M push through the object store is verified by
    fingerprint, changes the completions, the worker moves to other cores in place, and
    nothing is left in /dev/shm afterwards."""
    from periodic_rl.models import load_causal_lm

    model = load_causal_lm(smollm2_path, dtype=torch.float32)
    shm_before = set(os.listdir("/dev/shm"))
    rollouts = ray_rollouts(
        smollm2_path,
        1,
        kind="vllm",
        engine_kwargs={"max_model_len": 512, "kv_cache_gb": 0.5},
        worker_cores=[[1]],
        groups_per_call=4,
    ).start()
    try:
        jobs = [GroupJob(i, [1, 504, 3016, 28 + i], n=2, seed=i) for i in range(4)]
        sampling = SamplingConfig(max_new_tokens=16)
        first = by_index(rollouts.generate(jobs, sampling, version=0))
        assert first == by_index(rollouts.generate(jobs[::-1], sampling, version=0))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        state = model.state_dict()
        began = time.time()
        fingerprint = rollouts.push_weights(state, version=1)
        push_s = time.time() - began
        assert fingerprint == weights_fingerprint(state)
        second = list(rollouts.generate(jobs, sampling, version=1))
        assert by_index(second) != first
        assert all(g.fingerprint == weights_fingerprint(state) for g in second)
        info = rollouts.worker_info()[0]
        moved = moved_in_place(rollouts, info, jobs, sampling)
        print(
            f"\nvLLM RayRollouts: ray init {rollouts.timings['ray_init_s']:.1f} s, worker start "
            f"{rollouts.timings['workers_start_s']:.1f} s (engine {info['startup_s']:.1f} s), push "
            f"{push_s:.2f} s (put {rollouts.timings['last_push_put_s']:.2f}, hash done at "
            f"{rollouts.timings['last_push_hash_done_s']:.2f}, load until "
            f"{rollouts.timings['last_push_s']:.2f}); moved to all cores and back in place "
            f"in {moved:.2f} s"
        )
        pids = rollouts.worker_pids()
    finally:
        rollouts.shutdown()
    assert gone(pids)
    new = {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith(("psm_", "sem.mp-"))}
    held = {os.path.basename(f) for f in shm_files(psutil.pids())}  # another test's, in use
    assert not new - held


def test_engine_that_cannot_start_fails_fast(tmp_path):
    broken = ray_rollouts(str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match="failed to start"):
        broken.start()
    assert broken.restarts == 0  # refused at the first failure, no restart attempted


def test_abandoned_iteration_does_not_leak_into_the_next(rollouts2):
    jobs = make_jobs(6)
    version = rollouts2.version or 0
    clean = by_index(rollouts2.generate(jobs, SAMPLING, version))
    stream = rollouts2.generate(jobs, SAMPLING, version)
    next(stream)
    stream.close()  # the consumer stops early: in-flight calls are dropped
    assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == clean
