"""Each rollout default that differs between a CPU and a GPU run, and who wins over it.

The GPU side is exercised on this CPU machine with Lightning's CUDA accelerator mocked: the
strategy, the engine spec the workers are built from and the push transport must all pick the
GPU settings; nothing is run on a GPU here.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from periodic_rl import PeriodicAsyncStrategy
from periodic_rl.rollout import controller as controller_module
from periodic_rl.rollout.device_defaults import (
    GPU_MEMORY_ALONE,
    GPU_MEMORY_SHARED,
    LocalGpus,
    plan_local_gpus,
    resolve_rollout,
)
from periodic_rl.rollout.options import RolloutOptions
from periodic_rl.rollout.processes import visible_gpus
from periodic_rl.rollout.ranks import SingleRank


def settings(device: str, trainer_gpus=(), total=0, **options):
    return resolve_rollout(RolloutOptions(**options), device, trainer_gpus, total)


# ---- one test per default that differs -------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "cpu", "gpu"),
    [("dtype", "float32", "bfloat16"), ("enforce_eager", True, False), ("kv_cache_gb", 1, None)],
)
def test_vllm_default_differs_between_cpu_and_gpu(key, cpu, gpu):
    assert settings("cpu").engine_kwargs[key] == cpu
    assert settings("cuda", [0], 2).engine_kwargs[key] == gpu


def test_vllm_gpu_memory_share_depends_on_sharing_a_gpu_with_the_trainer():
    assert "gpu_memory_utilization" not in settings("cpu").engine_kwargs
    alone = settings("cuda", trainer_gpus=[0], total=2)
    shared = settings("cuda", trainer_gpus=[0], total=1)
    assert alone.engine_kwargs["gpu_memory_utilization"] == GPU_MEMORY_ALONE
    assert shared.engine_kwargs["gpu_memory_utilization"] == GPU_MEMORY_SHARED


def test_tensor_parallel_workers_get_that_many_gpus_and_the_mp_executor():
    tp = settings("cuda", [0], 3, engine_kwargs={"tensor_parallel_size": 2})
    assert tp.gpus_per_worker == 2.0
    assert tp.engine_kwargs["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in settings("cuda", [0], 3).engine_kwargs


def test_gpus_per_worker_default():
    assert settings("cpu").gpus_per_worker == 0.0
    assert settings("cuda", [0], 2).gpus_per_worker == 1.0
    assert settings("cuda", [0], 2, gpus_per_worker=0.5).gpus_per_worker == 0.5


def test_push_transport_default():
    assert settings("cpu").push_transport == "object_store"
    assert settings("cuda", [0], 2).push_transport == "broadcast"
    assert settings("cuda", [0], 1).push_transport == "object_store"  # NCCL: one rank per GPU
    assert settings("cuda", [0], 2, push_transport="object_store").push_transport == "object_store"
    assert settings("cpu", push_transport="broadcast").push_transport == "broadcast"


def test_hf_engine_default_differs_between_cpu_and_gpu():
    assert settings("cpu", engine="hf").engine_kwargs == {"dtype": "float32", "device": "cpu"}
    assert settings("cuda", [0], 2, engine="hf").engine_kwargs == {
        "dtype": "bfloat16",
        "device": "cuda",
    }


def test_what_the_user_sets_wins():
    given = {"dtype": "float16", "enforce_eager": True, "gpu_memory_utilization": 0.5}
    resolved = settings("cuda", [0], 1, engine_kwargs=given).engine_kwargs
    assert {k: resolved[k] for k in given} == given


def test_a_users_own_engine_gets_no_defaults():
    assert settings("cuda", [0], 2, engine="my.module:Engine").engine_kwargs == {}


# ---- the local Ray's GPUs ----------------------------------------------------------------------
def test_workers_get_the_gpus_no_trainer_rank_uses():
    assert plan_local_gpus(4, [0, 1], 2, 1.0) == LocalGpus(ray_gpus=[2, 3], shared=False)
    assert plan_local_gpus(2, [0], 1, 1.0) == LocalGpus(ray_gpus=[1], shared=False)


def test_workers_share_the_trainers_gpus_when_too_few_are_free():
    assert plan_local_gpus(1, [0], 1, 1.0) == LocalGpus(ray_gpus=[0], shared=True)
    assert plan_local_gpus(2, [0], 2, 1.0) == LocalGpus(ray_gpus=[0, 1], shared=True)


def test_no_gpu_plan_without_gpus_or_on_a_cluster():
    assert plan_local_gpus(0, [], 1, 1.0) == LocalGpus()
    assert settings("cpu").local_gpus == LocalGpus()
    cluster = settings("cuda", [0], 1, ray_address="10.0.0.1:6379")
    assert cluster.local_gpus == LocalGpus()
    assert cluster.engine_kwargs["gpu_memory_utilization"] == GPU_MEMORY_ALONE


def test_visible_gpus_maps_through_an_existing_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    import os

    with visible_gpus([1, 2]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with visible_gpus([1]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


# ---- through the strategy, with the accelerator mocked --------------------------------------
@pytest.fixture
def two_fake_gpus(monkeypatch):
    """Lightning sees two CUDA devices on this CPU machine (nothing is run on them)."""
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


class RecordedRollouts:
    """Stands in for RayRollouts: records what the controller would start the workers with."""

    built: list[dict] = []

    def __init__(self, spec, **kwargs) -> None:
        RecordedRollouts.built.append({"spec": spec, **kwargs})

    def start(self) -> RecordedRollouts:
        return self


def test_strategy_on_a_gpu_trainer_starts_workers_with_gpu_settings(two_fake_gpus, monkeypatch):
    import periodic_rl.rollout.workers.rollouts as ray_rollouts

    monkeypatch.setattr(ray_rollouts, "RayRollouts", RecordedRollouts)
    RecordedRollouts.built.clear()
    strategy = PeriodicAsyncStrategy(engine="vllm", engine_kwargs={"max_model_len": 512})
    L.Trainer(logger=False, enable_checkpointing=False, accelerator="gpu", devices=1,
              strategy=strategy)  # fmt: skip
    assert strategy.root_device == torch.device("cuda", 0)
    resolved = strategy.rollout_settings
    strategy.rollouts.start("some/model", SingleRank, resolved)
    (built,) = RecordedRollouts.built
    kwargs = built["spec"].kwargs
    assert kwargs["dtype"] == "bfloat16" and kwargs["enforce_eager"] is False
    assert kwargs["max_model_len"] == 512 and kwargs["kv_cache_gb"] is None
    assert kwargs["gpu_memory_utilization"] == GPU_MEMORY_ALONE
    assert built["gpus_per_worker"] == 1.0
    assert built["push_transport"] == "broadcast"
    assert built["local_gpus"] == [1]  # cuda:0 trains, the local Ray gets cuda:1


def test_strategy_on_a_cpu_trainer_keeps_cpu_settings(monkeypatch):
    import periodic_rl.rollout.workers.rollouts as ray_rollouts

    monkeypatch.setattr(ray_rollouts, "RayRollouts", RecordedRollouts)
    RecordedRollouts.built.clear()
    strategy = PeriodicAsyncStrategy(engine="vllm")
    L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", strategy=strategy)
    strategy.rollouts.start("some/model", SingleRank, strategy.rollout_settings)
    (built,) = RecordedRollouts.built
    assert built["spec"].kwargs["dtype"] == "float32"
    assert built["spec"].kwargs["enforce_eager"] is True
    assert built["gpus_per_worker"] == 0.0
    assert built["push_transport"] == "object_store"
    assert built["local_gpus"] is None


def test_start_without_settings_is_a_cpu_run(monkeypatch):
    import periodic_rl.rollout.workers.rollouts as ray_rollouts

    monkeypatch.setattr(ray_rollouts, "RayRollouts", RecordedRollouts)
    RecordedRollouts.built.clear()
    controller_module.RolloutController(RolloutOptions(engine="hf")).start("m", SingleRank)
    assert RecordedRollouts.built[0]["spec"].kwargs == {"dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize(
    ("option", "value"), [("push_transport", "nccl"), ("placement_strategy", "pack")]
)
def test_unknown_choice_is_refused_naming_the_choices(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be one of .*got '{value}'"):
        PeriodicAsyncStrategy(engine="hf", **{option: value})
