"""The fingerprint an engine reports is of what it holds after a load, not of what it was sent:
a load that loses or changes a tensor on the way in makes the push fail.

HFEngine hashes its own state dict read back after the copy. vLLM repacks its linear layers on
the CPU, so its worker hashes each tensor as vLLM's loader took it in, reads back the parameters
vLLM keeps in checkpoint layout (embeddings, norms), and refuses a reload that vLLM's loader
reports incomplete (vLLM itself only warns).
"""

from __future__ import annotations

import pytest
import torch
from ray_fixtures import DroppingEngine

from periodic_rl.rollout.engines.hf_engine import HFEngine
from periodic_rl.weight_sync.fingerprint import weights_fingerprint


def test_hf_engine_reports_the_weights_it_holds(tiny_llama_path, make_trainer):
    engine = HFEngine(tiny_llama_path)
    state = make_trainer(tiny_llama_path).state_dict()
    assert engine.load_weights(state) == weights_fingerprint(state) == engine.fingerprint()
    # An fp32 engine given bf16 weights holds them exactly (widened): the sender's hash.
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert engine.load_weights(bf16) == weights_fingerprint(bf16)


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_hf_engine_that_drops_a_tensor_reports_other_weights(
    tiny_llama_path, make_trainer, partial
):
    engine = DroppingEngine(tiny_llama_path, drop="model.layers.0.self_attn.q_proj.weight")
    state = make_trainer(tiny_llama_path).state_dict()
    if partial:
        state = {k: v for k, v in state.items() if ".layers.0.self_attn." in k}
    assert engine.load_weights(state, partial=partial) != weights_fingerprint(state)
    kept = {k: v for k, v in state.items() if k != engine.drop}
    assert engine.load_weights(kept, partial=True) == weights_fingerprint(kept)  # the rest landed


@pytest.mark.vllm
def test_vllm_reload_that_loses_or_changes_a_tensor_reports_other_weights(
    vllm_tiny, vllm_tiny_path, make_trainer, monkeypatch
):
    from periodic_rl.models import load_causal_lm
    from periodic_rl.rollout.engines import vllm_worker

    state = make_trainer(vllm_tiny_path).state_dict()
    expected = weights_fingerprint(state)
    reload = vllm_worker._reload

    def dropping(name):
        def faulty(worker, weights, partial):
            return reload(worker, [(n, t) for n, t in weights if n != name], partial)

        return faulty

    def changing_after_load(worker, weights, partial):
        result = reload(worker, weights, partial)
        params = dict(worker.model_runner.get_model().named_parameters())
        params["model.layers.1.input_layernorm.weight"].data[0] += 1.0
        return result

    try:
        assert vllm_tiny.load_weights(state) == expected == vllm_tiny.fingerprint()
        timings = vllm_tiny.last_load_timings  # what the worker reports of the load's phases
        assert set(timings) == {"reload_s", "verify_s", "reset_prefix_s"}
        assert all(seconds >= 0 for seconds in timings.values())
        # q_proj lost between the engine and vLLM's loader. The library's fast full reload
        # finds the fused qkv_proj incomplete and fails the load; the engine then holds no
        # push's weights.
        q_proj = next(n for n in state if "q_proj" in n)
        monkeypatch.setattr(vllm_worker, "_reload", dropping(q_proj))
        with pytest.raises(RuntimeError, match="incomplete"):
            vllm_tiny.load_weights(state)
        assert vllm_tiny.fingerprint() != expected
        # Through vLLM's own reload, vLLM still reports qkv_proj loaded (q's part is left as
        # it was), so only the hash can tell.
        monkeypatch.setenv("PERIODIC_RL_VLLM_FAST_RELOAD", "0")
        assert vllm_tiny.load_weights(state) != expected
        assert vllm_tiny.fingerprint() != expected
        monkeypatch.delenv("PERIODIC_RL_VLLM_FAST_RELOAD")
        # A value that did not land in a parameter vLLM keeps as loaded (a norm, read back).
        monkeypatch.setattr(vllm_worker, "_reload", changing_after_load)
        assert vllm_tiny.load_weights(state) != expected
        # A parameter vLLM's loader never received: vLLM warns and goes on; the push fails.
        monkeypatch.setattr(vllm_worker, "_reload", dropping("model.norm.weight"))
        with pytest.raises(RuntimeError, match="unloaded: model.norm.weight"):
            vllm_tiny.load_weights(state)
    finally:
        monkeypatch.undo()
        original = load_causal_lm(vllm_tiny_path, dtype=torch.float32).state_dict()
        assert vllm_tiny.load_weights(original) == weights_fingerprint(original)  # as before
