"""Rollout worker faults on a local Ray with tiny HF engines: a worker killed during a weight
push, two workers killed in the same iteration, a worker that hangs in a call or in a weight
load (killed after ``call_timeout_s`` and restarted). Each fault is made deterministic by
files the workers look for (``ray_fixtures.GatedEngine``), never by timing; afterwards every
job was generated once and the groups equal a fault-free run's."""

from __future__ import annotations

import logging
import re
import time

import pytest
from test_ray_rollouts import SAMPLING, by_index, gone, make_jobs, ray_rollouts, reference_groups

from periodic_rl.weight_sync.fingerprint import weights_fingerprint

ray = pytest.importorskip("ray")

GATED = "ray_fixtures:GatedEngine"
#: The hung-worker tests' timeout: far above a healthy call of the tiny model (~0.1 s, a few
#: seconds on a loaded 2-core machine), short enough to keep the tests quick.
SHORT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def gate_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fault-gates")


@pytest.fixture(scope="module")
def rollouts2(tiny_llama_path, gate_dir):
    """Two gated workers, one group per call, Ray's restart budget high enough for the module."""
    rollouts = ray_rollouts(
        tiny_llama_path,
        2,
        kind=GATED,
        engine_kwargs={"gate_dir": str(gate_dir)},
        groups_per_call=1,
        max_restarts=10,
    ).start()
    yield rollouts
    rollouts.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    from periodic_rl.rollout.engines.hf_engine import HFEngine

    return HFEngine(tiny_llama_path)


@pytest.fixture
def short_timeout(rollouts2):
    before = rollouts2.call_timeout_s
    rollouts2.call_timeout_s = SHORT_TIMEOUT_S
    yield SHORT_TIMEOUT_S
    rollouts2.call_timeout_s = before


def held(rollouts) -> list[tuple[int | None, str]]:
    """(version, fingerprint) each worker holds now, asked of the worker itself."""
    return [
        (ray.get(s.actor.info.remote())["version"], ray.get(s.actor.fingerprint.remote()))
        for s in rollouts._slots
    ]


def counters(rollouts) -> tuple[int, int, int]:
    return rollouts.restarts, rollouts.redispatched_calls, rollouts.hung_restarts


def test_worker_killed_during_a_weight_push(
    rollouts2, reference, gate_dir, tiny_llama_path, make_trainer
):
    """Worker 0 dies inside its load of the new weights: the push still succeeds, the worker
    is restarted straight onto them (fingerprint checked), and generation equals a fault-free
    engine holding them."""
    state = make_trainer(tiny_llama_path, seed=11).state_dict()
    version = (rollouts2.version or 0) + 1
    victim = rollouts2.worker_pids()[0]
    restarts, resent, hung = counters(rollouts2)
    (gate_dir / f"die-load-{victim}").touch()
    try:
        fingerprint = rollouts2.push_weights(state, version)
    finally:
        (gate_dir / f"die-load-{victim}").unlink()
    assert fingerprint == weights_fingerprint(state) == rollouts2.fingerprint
    assert counters(rollouts2) == (restarts + 1, resent, hung)  # a death, not a hang
    info = rollouts2.worker_info()
    assert info[0]["pid"] != victim and gone([victim])
    assert held(rollouts2) == [(version, fingerprint)] * 2
    jobs = make_jobs(6)
    groups = list(rollouts2.generate(jobs, SAMPLING, version))
    reference.load_weights(state)
    assert by_index(groups) == reference_groups(reference, jobs)
    assert {g.worker for g in groups} == {0, 1} and {g.fingerprint for g in groups} == {fingerprint}


def test_restarts_count_in_a_row_not_over_the_run(rollouts2, gate_dir):
    """With ``max_restarts=1``, worker 0 dies in three iterations, returning calls in between:
    each death is isolated, so the run goes on (a long run survives any number of them)."""
    jobs = make_jobs(4)
    version = rollouts2.version or 0
    clean = by_index(rollouts2.generate(jobs, SAMPLING, version))
    before, rollouts2.max_restarts = rollouts2.max_restarts, 1
    try:
        for _ in range(3):
            victim = rollouts2.worker_pids()[0]
            (gate_dir / f"die-generate-{victim}").touch()
            try:
                assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == clean
            finally:
                (gate_dir / f"die-generate-{victim}").unlink()
            assert rollouts2.worker_pids()[0] != victim
            assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == clean  # it serves
    finally:
        rollouts2.max_restarts = before


def test_two_workers_killed_in_the_same_iteration(rollouts2, gate_dir):
    """Both workers die at their first call of one iteration (each holding two calls): both
    are replaced, every job comes back once, and the groups equal the fault-free ones."""
    jobs = make_jobs(10)
    version = rollouts2.version or 0
    clean = by_index(rollouts2.generate(jobs, SAMPLING, version))
    victims = rollouts2.worker_pids()
    restarts, resent, hung = counters(rollouts2)
    files = [gate_dir / f"die-generate-{pid}" for pid in victims]
    for file in files:
        file.touch()
    try:
        groups = list(rollouts2.generate(jobs, SAMPLING, version))
    finally:
        for file in files:
            file.unlink()
    assert sorted(g.index for g in groups) == [j.index for j in jobs]  # each exactly once
    assert by_index(groups) == clean
    per_worker = rollouts2.max_calls_in_flight  # both calls of each dead worker were sent again
    assert counters(rollouts2) == (restarts + 2, resent + 2 * per_worker, hung)
    assert gone(victims) and set(rollouts2.worker_pids()).isdisjoint(victims)


def test_hung_worker_is_killed_and_its_calls_sent_again(rollouts2, gate_dir, short_timeout, caplog):
    """Worker 0's calls never return (a hold never removed): after ``call_timeout_s`` it is
    killed and restarted, its two calls go out again with the same seeds, and the iteration
    equals the fault-free one."""
    jobs = make_jobs(10)
    version = rollouts2.version or 0
    clean = by_index(rollouts2.generate(jobs, SAMPLING, version))
    victim = rollouts2.worker_pids()[0]
    restarts, resent, hung = counters(rollouts2)
    hold = gate_dir / f"hold-{victim}"
    hold.touch()
    began = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="periodic_rl.rollout.workers.rollouts"):
            groups = list(rollouts2.generate(jobs, SAMPLING, version))
    finally:
        hold.unlink()
    elapsed = time.monotonic() - began
    assert sorted(g.index for g in groups) == [j.index for j in jobs]
    assert by_index(groups) == clean
    assert counters(rollouts2) == (restarts + 1, resent + rollouts2.max_calls_in_flight, hung + 1)
    assert rollouts2.worker_pids()[0] != victim and gone([victim])
    (warning,) = [r.getMessage() for r in caplog.records if "returned no call" in r.getMessage()]
    assert f"rollout worker 0 (pid {victim})" in warning and f"={short_timeout:g}" in warning
    waited = float(re.search(r"for ([\d.]+) s", warning).group(1))
    # never before the timeout: hung_slots reports only past it; the log rounds to 0.1 s
    assert waited >= short_timeout
    print(f"\nhung call found after {waited:.1f} s (timeout {short_timeout} s); "
          f"iteration took {elapsed:.1f} s")  # fmt: skip


def test_a_slow_consumer_is_not_a_hang(rollouts2, short_timeout):
    """The trainer may take longer than ``call_timeout_s`` between two groups (the generator
    waits at a ``yield``): results that wait to be taken are progress, not a hang."""
    jobs = make_jobs(6)
    version = rollouts2.version or 0
    before = counters(rollouts2)
    groups = []
    for group in rollouts2.generate(jobs, SAMPLING, version):
        if not groups:
            time.sleep(short_timeout * 1.5)  # every call of both workers finishes meanwhile
        groups.append(group)
    assert sorted(g.index for g in groups) == [j.index for j in jobs]
    assert counters(rollouts2) == before


def test_hung_weight_load_is_killed_and_restarted_onto_the_pushed_weights(
    rollouts2, reference, gate_dir, short_timeout, tiny_llama_path, make_trainer
):
    """Worker 1's load of new weights never returns: after ``call_timeout_s`` it is killed and
    restarted straight onto them; the push succeeds, verified."""
    state = make_trainer(tiny_llama_path, seed=12).state_dict()
    version = (rollouts2.version or 0) + 1
    victim = rollouts2.worker_pids()[1]
    restarts, resent, hung = counters(rollouts2)
    hold = gate_dir / f"hold-load-{victim}"
    hold.touch()
    began = time.monotonic()
    try:
        fingerprint = rollouts2.push_weights(state, version)
    finally:
        hold.unlink()
    took = time.monotonic() - began
    assert fingerprint == weights_fingerprint(state)
    assert counters(rollouts2) == (restarts + 1, resent, hung + 1)
    info = rollouts2.worker_info()
    assert info[1]["pid"] != victim and gone([victim])
    assert held(rollouts2) == [(version, fingerprint)] * 2
    assert took > short_timeout
    jobs = make_jobs(6)
    reference.load_weights(state)
    assert by_index(rollouts2.generate(jobs, SAMPLING, version)) == reference_groups(
        reference, jobs
    )
    print(f"\nhung load: push took {took:.1f} s (timeout {short_timeout} s)")


def test_a_worker_that_always_hangs_fails_clearly(tiny_llama_path, gate_dir):
    """Past ``max_restarts`` a hang is fatal, and the error says which knob to turn."""
    rollouts = ray_rollouts(
        tiny_llama_path,
        1,
        kind=GATED,
        engine_kwargs={"gate_dir": str(gate_dir)},
        groups_per_call=1,
        max_restarts=0,
        call_timeout_s=2.0,
    ).start()
    hold = gate_dir / f"hold-{rollouts.worker_pids()[0]}"
    hold.touch()
    try:
        with pytest.raises(
            RuntimeError, match=r"worker 0 failed 1 times in a row .*raise call_timeout_s"
        ):
            list(rollouts.generate(make_jobs(2), SAMPLING, 0))
    finally:
        hold.unlink()
        rollouts.shutdown()


def test_call_timeout_must_be_positive(tiny_llama_path):
    with pytest.raises(ValueError, match="call_timeout_s"):
        ray_rollouts(tiny_llama_path, call_timeout_s=0)
