"""RolloutWorker used in-process (no Ray), and EngineSpec."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from periodic_rl.rollout.processes import descendants
from periodic_rl.rollout.spec import EngineSpec
from periodic_rl.rollout.types import GroupJob, SamplingConfig
from periodic_rl.rollout.workers.worker import RolloutWorker, StaleWeightsError
from periodic_rl.weight_sync.fingerprint import weights_fingerprint
from periodic_rl.weight_sync.transport import to_payload

SAMPLING = SamplingConfig(max_new_tokens=6)


# ---- EngineSpec -------------------------------------------------------------------------------
def test_engine_spec_kinds_and_validation():
    spec = EngineSpec("hf", "some/model", {"dtype": "float32"})
    assert spec.class_path == "periodic_rl.rollout.engines.hf_engine:HFEngine"
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(EngineSpec("hf", "some/model", {"device": "cpu"}))
    assert EngineSpec("vllm", "m").uses_vllm and not spec.uses_vllm
    assert EngineSpec("my_pkg.engines:MyEngine", "m").class_path == "my_pkg.engines:MyEngine"
    for bad in ["vLLM", "transformers", "pkg.module", "pkg:", ":Cls", ""]:
        with pytest.raises(ValueError, match="engine kind|non-empty"):
            EngineSpec(bad, "m")
    with pytest.raises(ValueError, match="model"):
        EngineSpec("hf", "")
    with pytest.raises(ImportError, match="no_such_module"):
        EngineSpec("no_such_module:Engine", "m").engine_class()
    with pytest.raises(TypeError, match="not an InferenceEngine"):
        EngineSpec("periodic_rl.rollout.types:SamplingConfig", "m").engine_class()


def test_engine_spec_copies_kwargs():
    kwargs = {"dtype": "float32"}
    spec = EngineSpec("hf", "m", kwargs)
    kwargs["dtype"] = "bfloat16"
    assert spec.kwargs == {"dtype": "float32"}


# ---- the worker class, in this process ----------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tiny_llama_path) -> RolloutWorker:
    return RolloutWorker(3, EngineSpec("hf", tiny_llama_path))


def jobs() -> list[GroupJob]:
    return [GroupJob(index=i, prompt_ids=[1, 504, 3016 + i], n=2, seed=10 + i) for i in range(3)]


def test_worker_generates_and_stamps(worker):
    groups = worker.generate(jobs(), SAMPLING, version=0)
    assert [g.index for g in groups] == [0, 1, 2]
    assert all(g.worker == 3 and g.version == 0 for g in groups)
    assert all(g.fingerprint == worker.fingerprint() for g in groups)
    assert all(g.seed == 10 + g.index and g.started <= g.finished for g in groups)
    assert all(len(g.completion_ids) == 2 for g in groups)
    again = worker.generate(jobs()[::-1], SAMPLING, version=0)
    assert {g.index: g.completion_ids for g in again} == {g.index: g.completion_ids for g in groups}
    info = worker.info()
    assert info["pid"] == worker.pid() and info["worker"] == 3 and info["version"] is None


def test_worker_loads_weights_and_refuses_other_versions(worker, tiny_llama_path):
    from periodic_rl.models import load_causal_lm

    model = load_causal_lm(tiny_llama_path, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    before = worker.generate(jobs(), SAMPLING, version=0)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-1.5)
    fingerprint = worker.load_weights(to_payload(model.state_dict()), version=7)
    assert fingerprint == weights_fingerprint(model.state_dict()) == worker.fingerprint()
    after = worker.generate(jobs(), SAMPLING, version=7)
    assert all(g.fingerprint == fingerprint and g.version == 7 for g in after)
    assert [g.completion_ids for g in after] != [g.completion_ids for g in before]
    with pytest.raises(StaleWeightsError, match="version 7"):
        worker.generate(jobs(), SAMPLING, version=6)
    worker.load_weights(to_payload(original), version=8)  # leave the module fixture as it was
    assert [g.completion_ids for g in worker.generate(jobs(), SAMPLING, 8)] == [
        g.completion_ids for g in before
    ]


def test_worker_reports_the_phases_of_its_last_load(tiny_llama_path):
    """``load_timings``: empty before a load, then the fetch, the engine's load and the page
    faults of the last one (what ``benchmarks/push.py`` breaks a push down with)."""
    from periodic_rl.models import load_causal_lm

    fresh = RolloutWorker(0, EngineSpec("hf", tiny_llama_path))
    try:
        assert fresh.load_timings() == {}
        state = load_causal_lm(tiny_llama_path, dtype=torch.float32).state_dict()
        fresh.load_weights(to_payload(state), version=1)
        timings = fresh.load_timings()
        assert set(timings) >= {"load_s", "fetch_s", "install_s", "minor_faults"}
        assert 0 <= timings["fetch_s"] + timings["install_s"] <= timings["load_s"] + 1e-6
        assert timings["load_s"] == fresh.info()["last_load_s"]
        assert isinstance(timings["minor_faults"], int) and timings["minor_faults"] >= 0
    finally:
        fresh.shutdown()


def test_worker_adapter_push_merges_into_the_kept_base(worker, tiny_llama_path):
    from lora_helpers import peft_policy

    from periodic_rl.weight_sync.export import (
        adapted_names,
        lora_adapter_payload,
        lora_base_state_dict,
        policy_state_dict,
    )
    from periodic_rl.weight_sync.fingerprint import adapter_fingerprint

    policy = peft_policy(tiny_llama_path)
    payload = lora_adapter_payload(policy)
    base = lora_base_state_dict(policy)  # the checkpoint's weights: the fixture is left as it was
    worker.load_weights(to_payload(base), version=9)
    with pytest.raises(RuntimeError, match="keep="):  # no base kept for adapters
        worker.load_adapter(to_payload(payload), version=10)
    base_fingerprint = worker.load_weights(to_payload(base), 9, keep=adapted_names(payload))
    fingerprint = worker.load_adapter(to_payload(payload), version=10)
    assert fingerprint == adapter_fingerprint(base_fingerprint, payload) == worker.fingerprint()
    groups = worker.generate(jobs(), SAMPLING, version=10)
    assert all(g.fingerprint == fingerprint and g.version == 10 for g in groups)
    own = worker.engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in policy_state_dict(policy).items())
    assert worker.info()["fingerprint"] == fingerprint  # what a restarted worker reports
    worker.load_weights(to_payload(base), version=11)  # a full push forgets the kept base
    with pytest.raises(RuntimeError, match="keep="):
        worker.load_adapter(to_payload(payload), version=12)


def test_worker_shutdown_is_final(tiny_llama_path):
    # In this test the worker lives in pytest's own process, whose children may include what
    # earlier tests started (a Ray session): only children the worker left behind count.
    already_there = {tuple(d) for d in descendants(os.getpid())}
    worker = RolloutWorker(0, EngineSpec("hf", tiny_llama_path))
    report = worker.shutdown()
    assert report["pid"] == worker.pid()
    assert {tuple(d) for d in report["descendants"]} <= already_there
    worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.generate(jobs(), SAMPLING, 0)
