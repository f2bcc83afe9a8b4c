"""The settings whose defaults differ between a CPU run and a GPU run, in one place.

A YAML written for the CPU runs on a GPU node with ``trainer.accelerator: gpu``: whatever the
user left unset is filled in from the kind of the training device (:func:`resolve_rollout`,
:func:`training_dtype`, :func:`importance_cap`), and what the user set always wins.

The trainer's side (``RLModule``):

=========================  =======================  =========================================
setting                    CPU                      GPU (training device ``cuda``)
=========================  =======================  =========================================
``dtype: auto``            ``float32``              ``bfloat16``
``tis_cap: auto``          cap 2 unless the engine  cap 2 unless the engine is ``hf`` in the
                           is ``hf`` in the         trainer's dtype (the same numerics)
                           trainer's dtype
=========================  =======================  =========================================

The rollout side (the strategy):

=========================  =======================  =========================================
setting                    CPU                      GPU (training device ``cuda``)
=========================  =======================  =========================================
vLLM ``dtype``             ``float32``              ``bfloat16``
vLLM ``enforce_eager``     ``True`` (fast start)    ``False`` (CUDA graphs)
vLLM ``kv_cache_gb``       ``1``                    unset: ``gpu_memory_utilization`` sizes it
vLLM ``gpu_memory_util.``  (not used)               ``0.9`` on its own GPU, ``0.3`` on a GPU
                                                    shared with a training rank
vLLM ``distributed_exec``  (not used)               ``mp`` when ``tensor_parallel_size > 1``
HF engine ``device``       ``cpu``                  ``cuda`` (Ray sets the worker's GPU)
HF engine ``dtype``        ``float32``              ``bfloat16``
``gpus_per_worker``        ``0``                    the engine's ``tensor_parallel_size`` (1)
``push_transport``         ``object_store``         ``broadcast`` (NCCL, no host round trip);
                                                    ``object_store`` on a shared GPU
=========================  =======================  =========================================

On one machine the local Ray cluster is given only the GPUs the training ranks do not use
(:func:`plan_local_gpus`); when there are not enough of them, the workers share the training
ranks' GPUs and vLLM takes a smaller share of their memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

#: ``push_transport`` values: ``object_store`` (host memory and Ray's object store; any
#: device), ``broadcast`` (a collective from the trainer into the workers: NCCL between GPUs,
#: gloo between CPUs), ``auto`` (``broadcast`` on GPUs, ``object_store`` on the CPU).
PushTransport = Literal["auto", "object_store", "broadcast"]
PUSH_TRANSPORTS: tuple[str, ...] = get_args(PushTransport)

#: Ray placement-group strategies a worker set may be placed with.
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES: tuple[str, ...] = get_args(PlacementStrategy)

CPU_VLLM = {"dtype": "float32", "enforce_eager": True, "kv_cache_gb": 1}
GPU_VLLM = {"dtype": "bfloat16", "enforce_eager": False, "kv_cache_gb": None}
#: vLLM's share of a GPU's memory: alone on it (vLLM's own default), or beside a training rank.
GPU_MEMORY_ALONE = 0.9
GPU_MEMORY_SHARED = 0.3
CPU_HF = {"dtype": "float32", "device": "cpu"}
GPU_HF = {"dtype": "bfloat16", "device": "cuda"}


@dataclass(frozen=True)
class LocalGpus:
    """How one machine's GPUs are split between the training ranks and a local Ray cluster.

    Attributes:
        ray_gpus: the CUDA device indices the local Ray may give to workers (``None``: do not
            restrict Ray; there are no GPUs, or Ray is a cluster the user started).
        shared: the workers run on GPUs a training rank also uses.
    """

    ray_gpus: list[int] | None = None
    shared: bool = False


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout options with every device-dependent default filled in."""

    device_type: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    gpus_per_worker: float = 0.0
    push_transport: str = "object_store"
    local_gpus: LocalGpus = LocalGpus()

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"


def plan_local_gpus(
    total: int, trainer_gpus: Sequence[int], num_workers: int, gpus_per_worker: float
) -> LocalGpus:
    """Give the workers of a local Ray the GPUs the training ranks leave free, if they fit
    there; else let them share all ``total`` GPUs with the ranks (``shared``)."""
    if total <= 0 or gpus_per_worker <= 0:
        return LocalGpus()
    free = [i for i in range(total) if i not in set(trainer_gpus)]
    if free and num_workers * gpus_per_worker <= len(free):
        return LocalGpus(ray_gpus=free, shared=False)
    return LocalGpus(ray_gpus=list(range(total)), shared=bool(trainer_gpus))


def resolve_rollout(
    options: Any,
    device_type: str,
    trainer_gpus: Sequence[int] = (),
    total_gpus: int = 0,
) -> RolloutSettings:
    """``options`` (:class:`~periodic_rl.rollout.controller.RolloutOptions`) with the defaults of
    the table in the module docstring filled in for a training device of ``device_type``.

    ``trainer_gpus`` / ``total_gpus``: the CUDA indices the training ranks of this machine use
    and how many it has; they decide, for a local Ray, which GPUs the workers get and whether
    they share them (:func:`plan_local_gpus`)."""
    on_gpu = device_type == "cuda"
    given = dict(options.engine_kwargs)
    tensor_parallel = int(given.get("tensor_parallel_size", 1) or 1)
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = float(tensor_parallel) if on_gpu else 0.0
    local = LocalGpus()
    if on_gpu and options.ray_address is None and options.use_ray:
        local = plan_local_gpus(total_gpus, trainer_gpus, options.num_workers, gpus)
    elif on_gpu and not options.use_ray:
        local = LocalGpus(shared=True)  # the engine lives in the training process
    defaults: dict[str, Any] = {}
    if options.engine == "vllm":
        defaults = dict(GPU_VLLM if on_gpu else CPU_VLLM)
        if on_gpu:
            defaults["gpu_memory_utilization"] = (
                GPU_MEMORY_SHARED if local.shared else GPU_MEMORY_ALONE
            )
            if tensor_parallel > 1:
                defaults["distributed_executor_backend"] = "mp"
    elif options.engine == "hf":
        defaults = dict(GPU_HF if on_gpu else CPU_HF)
    transport = options.push_transport
    if transport == "auto":  # NCCL cannot join two ranks on one GPU: shared GPUs use the store
        broadcast = on_gpu and options.use_ray and not local.shared
        transport = "broadcast" if broadcast else "object_store"
    return RolloutSettings(
        device_type=device_type,
        engine_kwargs={**defaults, **given},
        gpus_per_worker=float(gpus),
        push_transport=transport,
        local_gpus=local,
    )


# ---- the engine's dtype ---------------------------------------------------------------------
DTYPES = ("float32", "bfloat16")
ENGINE_DTYPES = (*DTYPES, "auto")


def check_engine_dtype(engine_dtype: str | None, engine: str, engine_kwargs: dict) -> None:
    """At the strategy's construction: a known value, not given twice, ``auto`` only for the
    engines it knows how to resolve."""
    if engine_dtype is None:
        return
    if engine_dtype not in ENGINE_DTYPES:
        raise ValueError(
            f"engine_dtype must be one of {', '.join(ENGINE_DTYPES)} or null (engine_kwargs' "
            f"dtype, else the device's default), got {engine_dtype!r}"
        )
    if "dtype" in engine_kwargs:
        raise ValueError(
            f"engine_dtype={engine_dtype!r} and engine_kwargs.dtype={engine_kwargs['dtype']!r} "
            "both set the rollout engine's dtype; keep one of them (engine_dtype takes float32, "
            "bfloat16 or auto)"
        )
    if engine_dtype == "auto" and engine not in ("vllm", "hf"):
        raise ValueError(
            f"engine_dtype='auto' is resolved for the vllm and hf engines only, not {engine!r}; "
            "give engine_dtype float32 or bfloat16"
        )


def default_engine_dtype(engine: str, on_gpu: bool) -> str:
    """What ``engine_dtype: auto`` means where no tuner measures it: bfloat16 on GPUs, else
    float32."""
    return "bfloat16" if on_gpu else "float32"


# ---- the trainer's dtype and the engine/trainer correction ----------------------------------
#: ``RLModule(dtype="auto")``: bfloat16 weights where tensor cores run them, float32 elsewhere.
TRAINING_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
#: The truncation cap ``tis_cap: auto`` uses when the correction is on (TRL's and verl's 2).
AUTO_TIS_CAP = 2.0


def training_dtype(dtype: str, device_type: str) -> str:
    """The policy's weight dtype: ``dtype``, or for ``auto`` the training device's default."""
    if dtype != "auto":
        return dtype
    return TRAINING_DTYPES.get(device_type, "float32")


#: Lightning precisions whose forward computes in another dtype than the weights' (autocast, or
#: weights converted by the precision plugin).
PRECISION_DTYPES = {
    "bf16-mixed": "bfloat16",
    "bf16-true": "bfloat16",
    "16-mixed": "float16",
    "16-true": "float16",
    "64-true": "float64",
}


def compute_dtype(train_dtype: str, precision: str = "32-true") -> str:
    """The dtype the trainer's forward computes its log-probs in: the precision's (``bf16-mixed``
    and the like), else the weights' (``train_dtype``)."""
    return PRECISION_DTYPES.get(str(precision), train_dtype)


def importance_cap(
    tis_cap: float | str | None,
    engine: str,
    engine_dtype: str | None,
    train_dtype: str,
    precision: str = "32-true",
) -> float | None:
    """The truncated-importance-sampling cap a run uses: ``tis_cap`` as given, or for ``auto``
    :data:`AUTO_TIS_CAP` whenever the engine's numerics differ from the trainer's (vLLM's
    kernels, or an engine dtype other than the one the trainer computes in under
    ``precision``) and None (off) when they are the same: the ``hf`` engine in the trainer's
    compute dtype. An engine of the user's own is not known to report behaviour log-probs,
    so ``auto`` leaves it off (give ``tis_cap`` a number to turn it on)."""
    if tis_cap != "auto":
        return None if tis_cap is None else float(tis_cap)
    if engine == "vllm":
        return AUTO_TIS_CAP
    if engine == "hf":
        same = (None, compute_dtype(train_dtype, precision))
        return None if engine_dtype in same else AUTO_TIS_CAP
    return None
