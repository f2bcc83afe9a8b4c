"""``engine_dtype``: the chooser's rule, the cache, the strategy's checks at construction, the
choice reaching the engine, and one real measurement on the tiny vLLM model.

Nothing here asserts which dtype is faster: that is the machine's to say.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from rl_helpers import starting_threads

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.cpu_tuning import engine_dtype
from periodic_rl.cpu_tuning.engine_dtype import (
    BF16_MARGIN,
    DtypeChoice,
    cache_key,
    choose_dtype,
    measure,
    read_cache,
    resolve_engine_dtype,
    write_cache,
)


# ---- the rule --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ({"float32": 75.0, "bfloat16": 19.0}, "float32"),  # the AVX512-BF16 EPYC of the issue
        ({"float32": 20.0, "bfloat16": 75.0}, "bfloat16"),
        ({"float32": 50.0, "bfloat16": 50.0}, "float32"),  # a tie keeps the exact dtype
        ({"float32": 50.0, "bfloat16": 54.0}, "float32"),  # 8% faster: inside the margin
        ({"float32": 50.0, "bfloat16": 55.5}, "bfloat16"),  # 11% faster: outside it
        ({"float32": 50.0, "bfloat16": 50.0 * BF16_MARGIN}, "bfloat16"),  # exactly the margin
        ({"float32": 50.0}, "float32"),  # bf16 not measured
        ({"bfloat16": 10.0}, "bfloat16"),  # float32 not measured (failed): the one that ran
        ({}, "float32"),
        ({"float32": 0.0, "bfloat16": 0.0}, "float32"),
    ],
)
def test_choose_dtype(rates, expected):
    assert choose_dtype(rates) == expected


def test_margin_is_ten_percent():
    assert BF16_MARGIN == pytest.approx(1.10)


def test_choose_dtype_refuses_negative_rates():
    with pytest.raises(ValueError, match=">= 0 tokens/s"):
        choose_dtype({"float32": -1.0, "bfloat16": 2.0})


def test_choice_metrics_and_description():
    choice = DtypeChoice("bfloat16", {"float32": 10.0, "bfloat16": 30.0}, "cache")
    assert choice.metrics() == {
        "engine_dtype/bfloat16": 1.0,
        "engine_dtype/float32_tok_s": 10.0,
        "engine_dtype/bfloat16_tok_s": 30.0,
    }
    assert "-> bfloat16" in choice.describe() and "cache" in choice.describe()


# ---- the cache -------------------------------------------------------------------------------
def test_cache_key_names_machine_versions_and_model(tiny_llama_path):
    key = cache_key(tiny_llama_path, 3)
    assert key["cores"] == 3
    assert key["model"] == {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 49152,
    }
    assert key["torch"] and key["vllm"] and key["cpu"]
    assert set(key["flags"]) <= {"avx512_bf16", "amx_bf16"}
    assert cache_key(tiny_llama_path, 1) != key


def test_cache_round_trip_hit_and_miss(tmp_path, tiny_llama_path):
    path = tmp_path / "sub" / "engine_dtype.json"
    key = cache_key(tiny_llama_path, 1)
    other = {**key, "cores": 2}
    assert read_cache(path, key) is None  # no file yet
    write_cache(path, key, {"float32": 70.0, "bfloat16": 20.0})
    assert read_cache(path, key) == {"float32": 70.0, "bfloat16": 20.0}
    assert read_cache(path, other) is None  # another key misses
    write_cache(path, other, {"float32": 1.0, "bfloat16": 2.0})  # a second entry, first kept
    assert read_cache(path, key) == {"float32": 70.0, "bfloat16": 20.0}
    assert read_cache(path, other) == {"float32": 1.0, "bfloat16": 2.0}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails half way leaves the old cache as it was and no temporary file."""
    path = tmp_path / "engine_dtype.json"
    write_cache(path, {"k": 1}, {"float32": 5.0})
    before = path.read_text()

    def broken_dump(obj, out, **kwargs):
        out.write('{"half": ')
        raise OSError("disk full")

    monkeypatch.setattr(engine_dtype.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        write_cache(path, {"k": 2}, {"float32": 6.0})
    assert path.read_text() == before
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"x": {"rates": "fast"}}'])
def test_corrupt_cache_is_ignored_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "engine_dtype.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=engine_dtype.__name__):
        assert read_cache(path, {"x": 1}) is None
        write_cache(path, {"k": 1}, {"float32": 5.0})  # replaces an unreadable file
    assert read_cache(path, {"k": 1}) == {"float32": 5.0}
    if content != '{"x": {"rates": "fast"}}':  # a JSON object of entries is not unreadable
        assert "unreadable" in caplog.text


def test_cache_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(engine_dtype.CACHE_ENV, str(tmp_path / "x.json"))
    assert engine_dtype.cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(engine_dtype.CACHE_ENV)
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    assert engine_dtype.cache_path() == tmp_path / "engine_dtype.json"


def test_resolve_reads_the_cache_without_measuring(tmp_path, tiny_llama_path, monkeypatch):
    path = tmp_path / "engine_dtype.json"
    write_cache(path, cache_key(tiny_llama_path, 1), {"float32": 20.0, "bfloat16": 80.0})

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the cache had the rates")

    monkeypatch.setattr(engine_dtype, "measure", no_measuring)
    choice = resolve_engine_dtype("vllm", tiny_llama_path, [0], on_gpu=False, path=path)
    assert choice == DtypeChoice("bfloat16", {"float32": 20.0, "bfloat16": 80.0}, "cache")


def test_resolve_without_measuring_on_gpu_and_for_hf(tmp_path, tiny_llama_path, monkeypatch):
    monkeypatch.setattr(engine_dtype, "measure", None)  # would fail if called
    path = tmp_path / "none.json"
    assert resolve_engine_dtype("vllm", tiny_llama_path, [0], True, path).dtype == "bfloat16"
    assert resolve_engine_dtype("hf", tiny_llama_path, [0], False, path).dtype == "float32"
    assert not path.exists()


def test_a_failed_measurement_keeps_float32_and_caches_nothing(
    tmp_path, tiny_llama_path, monkeypatch
):
    def failing(*args, **kwargs):
        raise RuntimeError("exit code 1: vLLM refused bf16")

    monkeypatch.setattr(engine_dtype, "measure", failing)
    path = tmp_path / "engine_dtype.json"
    choice = resolve_engine_dtype("vllm", tiny_llama_path, [0], False, path)
    assert choice.dtype == "float32" and choice.source == "measurement failed"
    assert not path.exists()


# ---- the strategy --------------------------------------------------------------------------
def test_engine_dtype_and_engine_kwargs_dtype_together_are_refused():
    with pytest.raises(ValueError, match="engine_dtype='auto' and engine_kwargs.dtype='float32'"):
        PeriodicAsyncStrategy(engine_dtype="auto", engine_kwargs={"dtype": "float32"})
    with pytest.raises(ValueError, match="keep one of them"):
        PeriodicAsyncStrategy(engine="hf", engine_dtype="bfloat16", engine_kwargs={"dtype": "x"})


@pytest.mark.parametrize("value", ["fp32", "half", "AUTO", "float16"])
def test_unknown_engine_dtype_is_refused(value):
    with pytest.raises(ValueError, match="engine_dtype must be one of float32, bfloat16, auto"):
        PeriodicAsyncStrategy(engine_dtype=value)


def test_auto_is_refused_for_a_user_engine():
    with pytest.raises(ValueError, match="vllm and hf engines only"):
        PeriodicAsyncStrategy(engine="my_pkg.engines:Mine", engine_dtype="auto")


def test_a_concrete_engine_dtype_becomes_the_engine_dtype():
    strategy = PeriodicAsyncStrategy(engine="hf", engine_dtype="bfloat16", use_ray=False,
                                     overlap=False)  # fmt: skip
    assert strategy.rollouts.options.engine_kwargs == {"dtype": "bfloat16"}
    assert strategy.rollout_settings.engine_kwargs["dtype"] == "bfloat16"
    assert not strategy.engine_dtype_pending
    default = PeriodicAsyncStrategy(engine="hf", use_ray=False, overlap=False)
    assert default.rollout_settings.engine_kwargs["dtype"] == "float32"  # unchanged default
    assert "dtype" not in default.rollouts.options.engine_kwargs


def test_auto_is_resolved_at_setup_for_hf(tiny_llama_path):
    from rl_helpers import train

    strategy = {"engine": "hf", "use_ray": False, "overlap": False, "engine_dtype": "auto"}
    _, _, fitted = train(tiny_llama_path, steps=1, strategy=strategy)
    assert fitted.rollouts.options.engine_kwargs["dtype"] == "float32"
    assert (
        fitted.tuning.engine_dtype_choice is not None
        and "hf" in fitted.tuning.engine_dtype_choice.source
    )
    assert not fitted.engine_dtype_pending


@pytest.mark.vllm
def test_auto_reaches_vllm_as_the_cached_choice(tmp_path, vllm_slot, vllm_tiny_path, monkeypatch):
    """The choice (here from a cache that says bf16 is 4x faster) is the dtype vLLM runs in."""
    import torch
    from rl_helpers import train

    from periodic_rl.compat.vllm import vllm_model_dtype

    vllm_slot.release()  # one engine at a time
    # The engine runs in this process, and vLLM's CPU attention (bf16) checks that the host's
    # OpenMP thread count is the one it started with: an earlier test may have lowered it.
    torch.set_num_threads(starting_threads())
    cache = tmp_path / "engine_dtype.json"
    monkeypatch.setenv(engine_dtype.CACHE_ENV, str(cache))
    cores = len(os.sched_getaffinity(0))  # without Ray the engine runs on the trainer's cores
    write_cache(cache, cache_key(vllm_tiny_path, cores), {"float32": 10.0, "bfloat16": 40.0})
    monkeypatch.setattr(engine_dtype, "measure", None)  # a cache miss would fail here
    strategy = {
        "engine": "vllm",
        "use_ray": False,
        "overlap": False,
        "engine_dtype": "auto",
        "engine_kwargs": {"max_model_len": 256, "kv_cache_gb": 0.25},
    }
    seen = {}
    original = PeriodicAsyncStrategy.teardown

    def record_then_teardown(self):
        seen["dtype"] = vllm_model_dtype(self.rollouts.backend.engine.llm)
        original(self)

    monkeypatch.setattr(PeriodicAsyncStrategy, "teardown", record_then_teardown)
    _, _, fitted = train(vllm_tiny_path, steps=1, strategy=strategy)
    assert seen["dtype"] == torch.bfloat16
    assert fitted.tuning.engine_dtype_choice.source == "cache"
    assert fitted.rollouts.options.engine_kwargs["dtype"] == "bfloat16"


# ---- one real measurement ------------------------------------------------------------------
@pytest.mark.vllm
def test_real_measurement_on_the_tiny_model(vllm_tiny_path):
    """Both dtypes decode in the pinned child; the rates are positive and the choice one of
    the two. Times something: run it under ``flock /tmp/cpu.lock`` on a shared machine."""
    core = sorted(os.sched_getaffinity(0))[-1]
    rates = measure(vllm_tiny_path, [core], timeout_s=300)
    assert set(rates) == {"float32", "bfloat16"}
    assert all(rate > 0 for rate in rates.values())
    assert choose_dtype(rates) in ("float32", "bfloat16")
    json.dumps(rates)  # what the cache stores
