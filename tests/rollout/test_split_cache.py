"""The hardware split cache: its key, hits and misses, unreadable files, atomic writes, and the
warning when a cached split runs slower than predicted (no Ray, no engine)."""

import dataclasses
import json
import logging
import os
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from periodic_rl.cpu_tuning import split_cache
from periodic_rl.cpu_tuning.hardware_split import Candidate, MeasuredRates, SideTime, SplitModel
from periodic_rl.cpu_tuning.split_advisor import SplitStep
from periodic_rl.cpu_tuning.split_cache import (
    CACHE_ENV,
    CachedSplit,
    SplitCache,
    Workload,
    cache_key,
    read_cache,
    workload_of,
    write_cache,
)
from periodic_rl.rollout.options import RolloutOptions

WORKLOAD = Workload(
    num_generations=8,
    prompts_per_iteration=4,
    max_new_tokens=32,
    micro_batch_size=8,
    precision="32-true",
    engine="vllm",
    engine_kwargs={"dtype": "float32"},
    groups_per_call=None,
    training={"dtype": "float32", "lora": None},
)
RATES = MeasuredRates(SideTime(4.0, 1), SideTime(2.0, 1), 0.5, 5.5, True, 3)
CHOICE = CachedSplit(
    Candidate(False, (0, 1), ((0, 1),), 4.25),
    SplitModel(0.2, 0.7, overlap_cost_s=0.3, serial_s=0.5),
    (RATES, MeasuredRates(SideTime(3.0, 2), SideTime(1.5, 2), 0.5, 5.0, False, 3)),
    "2026-12-04T10:00:00+00:00",
)


def save_config(path, **overrides) -> str:
    """A model directory holding only its config (all a key reads)."""
    kwargs = {"vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 2} | overrides
    LlamaConfig(**kwargs).save_pretrained(path)
    return str(path)


@pytest.fixture
def model_dir(tmp_path):
    return save_config(tmp_path / "model")


# ---- the key ---------------------------------------------------------------------------------
def test_key_is_stable_and_names_machine_model_workload_and_versions(model_dir):
    key = cache_key([0, 1], 1, model_dir, WORKLOAD)
    assert key == cache_key((0, 1), 1, model_dir, dataclasses.replace(WORKLOAD))
    assert json.loads(json.dumps(key)) == key  # JSON values only: stored as written
    assert key["cores"] == [0, 1] and key["num_workers"] == 1 and key["cpu"]
    assert key["model"] == {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 49152,
    }
    assert key["workload"]["prompts_per_iteration"] == 4
    assert key["workload"]["engine_kwargs"] == {"dtype": "float32"}
    assert key["versions"]["periodic_rl"] and key["versions"]["torch"]


@pytest.mark.parametrize(
    "change",
    [
        {"cores": [0]},
        {"cores": [2, 3]},
        {"num_workers": 2},
        {"workload": {"num_generations": 4}},
        {"workload": {"prompts_per_iteration": 8}},
        {"workload": {"max_new_tokens": 64}},
        {"workload": {"micro_batch_size": 16}},
        {"workload": {"precision": "bf16-mixed"}},
        {"workload": {"engine_kwargs": {"dtype": "bfloat16"}}},
        {"workload": {"training": {"dtype": "float32", "lora": {"r": 8}}}},
        {"workload": {"lend_idle_cores": False}},
    ],
)
def test_another_machine_or_workload_gets_another_key(model_dir, change):
    key = cache_key([0, 1], 1, model_dir, WORKLOAD)
    workload = dataclasses.replace(WORKLOAD, **change.get("workload", {}))
    other = cache_key(
        change.get("cores", [0, 1]), change.get("num_workers", 1), model_dir, workload
    )
    assert other != key


def test_another_model_shape_gets_another_key(model_dir, tmp_path):
    wider = save_config(tmp_path / "wider", hidden_size=128)
    assert cache_key([0, 1], 1, wider, WORKLOAD) != cache_key([0, 1], 1, model_dir, WORKLOAD)
    unreadable = cache_key([0, 1], 1, str(tmp_path / "nowhere"), WORKLOAD)  # still a key
    assert unreadable["model"] == {"path": str(tmp_path / "nowhere")}


def test_workload_of_a_run():
    module = SimpleNamespace(
        hparams={"num_generations": 4, "max_new_tokens": 16, "dtype": "float32", "seed": 3},
        micro_batch_size=4,
    )
    trainer = SimpleNamespace(
        precision="32-true", datamodule=SimpleNamespace(hparams={"batch_size": 2})
    )
    options = RolloutOptions(engine="hf", engine_kwargs={"dtype": "float32"}, groups_per_call=1)
    assert workload_of(module, trainer, options, lend_idle_cores=True) == Workload(
        4, 2, 16, 4, "32-true", "hf", {"dtype": "float32"}, 1, {"dtype": "float32"}, True
    )  # the seed changes no speed: not in the key


# ---- reading and writing ---------------------------------------------------------------------
def test_hit_and_miss(tmp_path):
    path = tmp_path / "sub" / "hardware_split.json"
    key, other = {"k": 1}, {"k": 2}
    assert read_cache(path, key) is None  # no file yet
    write_cache(path, key, CHOICE)
    assert read_cache(path, key) == CHOICE  # every field back, tuples and all
    assert read_cache(path, other) is None
    write_cache(path, other, dataclasses.replace(CHOICE, date="later"))  # the first is kept
    assert read_cache(path, key) == CHOICE and read_cache(path, other).date == "later"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_open_looks_the_run_up(tmp_path, model_dir):
    path = tmp_path / "hardware_split.json"
    miss = SplitCache.open([0, 1], 1, model_dir, WORKLOAD, path)
    assert miss.hit is None and miss.key == cache_key([0, 1], 1, model_dir, WORKLOAD)
    write_cache(path, miss.key, CHOICE)
    assert SplitCache.open([0, 1], 1, model_dir, WORKLOAD, path).hit == CHOICE
    assert SplitCache.open([0, 1], 2, model_dir, WORKLOAD, path).hit is None


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"{\\"k\\": 1}": {"choice": {"split": 3}}}']
)
def test_an_unreadable_file_or_entry_is_ignored_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "hardware_split.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=split_cache.__name__):
        assert read_cache(path, {"k": 1}) is None
    assert "unreadable" in caplog.text and str(path) in caplog.text
    write_cache(path, {"k": 1}, CHOICE)  # replaces what it could not use
    assert read_cache(path, {"k": 1}) == CHOICE


def test_the_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails half way leaves the old file as it was and no temporary file; the
    file appears only whole, through the rename."""
    path = tmp_path / "hardware_split.json"
    write_cache(path, {"k": 1}, CHOICE)
    before = path.read_text()

    def broken_dump(obj, out, **kwargs):
        out.write('{"half": ')
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(split_cache.json, "dump", broken_dump)
        with pytest.raises(OSError, match="disk full"):
            write_cache(path, {"k": 2}, CHOICE)
    assert path.read_text() == before and os.listdir(tmp_path) == [path.name]

    seen = []
    real_replace = os.replace

    def replacing(src, dst):
        seen.append((path.read_text() == before, json.loads(open(src).read())))
        real_replace(src, dst)

    monkeypatch.setattr(split_cache.os, "replace", replacing)
    write_cache(path, {"k": 2}, CHOICE)
    ((old_until_renamed, whole),) = seen
    assert old_until_renamed and len(whole) == 2  # the temporary file was complete


def test_cache_path_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "x.json"))
    assert split_cache.cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("PERIODIC_RL_CACHE", str(tmp_path))
    assert split_cache.cache_path() == tmp_path / "hardware_split.json"


# ---- remembering and checking ----------------------------------------------------------------
def _step(wall_s: float) -> SplitStep:
    rates = dataclasses.replace(RATES, wall_s=wall_s)
    return SplitStep(rates, None, None, None, True, cached=True)


def test_a_cached_split_slower_than_predicted_is_warned_about(tmp_path, caplog):
    cache = SplitCache(tmp_path / "hardware_split.json", {"k": 1}, CHOICE)  # 4.25 s predicted
    with caplog.at_level(logging.WARNING, logger=split_cache.__name__):
        assert cache.check(_step(5.3))  # 25% slower: within the margin
        assert not caplog.records
        assert not cache.check(_step(5.4))
    (record,) = caplog.records
    message = record.getMessage()
    assert str(cache.path) in message and CACHE_ENV in message and "delete" in message


def test_an_unwritable_cache_costs_a_warning_only(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = SplitCache(blocker / "hardware_split.json", {"k": 1}, None)  # parent is a file
    plan_step = SplitStep(RATES, None, None, None, True)
    assert cache.remember(plan_step, [RATES]) is None  # no plan: nothing to remember
    from periodic_rl.cpu_tuning.hardware_split import choose_split

    plan = choose_split(RATES, (0, 1), 1)
    with caplog.at_level(logging.WARNING, logger=split_cache.__name__):
        assert cache.remember(dataclasses.replace(plan_step, plan=plan), [RATES]) is None
    assert "could not remember" in caplog.text
