"""The split ``worker_cores: auto`` chose, remembered per machine and workload.

Exploring the split costs a run time: each switch restarts the rollout workers (each builds its
engine again), which a short run never earns back. So a run that
explored writes its final choice here (:meth:`SplitCache.remember`), and the next run with the
same key (:func:`cache_key`: the CPU, this process's core ids, the workers, the model's shape,
the workload and the versions) starts directly on that split: its
:class:`~periodic_rl.cpu_tuning.split_advisor.SplitAdvisor` measures one window of it and logs it
(``split/cached`` 1), switching nothing. When that window runs more than
:data:`SLOWER_MARGIN` slower than the cached prediction, :meth:`SplitCache.check` warns; it does
not explore again by itself: delete the file, or point ``$PERIODIC_RL_SPLIT_CACHE`` elsewhere.

The file (:func:`cache_path`) is JSON, one entry per key, replaced atomically (a reader never
sees half a file); an unreadable file is ignored with a warning, as in
:mod:`~periodic_rl.cpu_tuning.engine_dtype`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from periodic_rl.cpu_tuning.engine_dtype import cpu_fields, model_shape, package_version
from periodic_rl.cpu_tuning.hardware_split import Candidate, MeasuredRates, SideTime, SplitModel
from periodic_rl.cpu_tuning.json_cache import read_entry, write_entry
from periodic_rl.cpu_tuning.split_advisor import SplitStep
from periodic_rl.rollout.options import RolloutOptions

log = logging.getLogger(__name__)

CACHE_ENV = "PERIODIC_RL_SPLIT_CACHE"
#: A cached split measured this much slower than predicted gets a warning (not a re-exploration).
SLOWER_MARGIN = 0.25
#: The module's hyperparameters that change how long training (or generation) takes.
TRAINING_HPARAMS = (
    "dtype",
    "lora",
    "gradient_checkpointing",
    "shared_prompt",
    "attention_backend",
    "num_iterations",
    "beta",
    "dynamic_sampling",
    "max_prompt_length",
)
_FORMAT = 2  # bumped when an entry's meaning changes: older entries then miss


@dataclass(frozen=True)
class Workload:
    """What one iteration asks of each side, as far as it changes how long the side works: the
    group size and groups per iteration, the completion cap, the micro-batch, the trainer's
    precision and further hyperparameters (:data:`TRAINING_HPARAMS`), the rollout engine with
    its kwargs (the resolved ``dtype`` among them), the groups per call, and whether the trainer
    borrows the workers' idle cores (``lend_idle_cores`` shortens an overlapped iteration)."""

    num_generations: int | None
    prompts_per_iteration: int | None
    max_new_tokens: int | None
    micro_batch_size: int | None
    precision: str | None
    engine: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    groups_per_call: int | None = None
    training: dict[str, Any] = field(default_factory=dict)
    lend_idle_cores: bool = True


def workload_of(
    module: Any, trainer: Any, options: RolloutOptions, lend_idle_cores: bool
) -> Workload:
    """The :class:`Workload` of a run, from its LightningModule (``hparams``), its Trainer
    (``precision``, the datamodule's ``batch_size``), its ``RolloutOptions`` and whether idle
    cores are lent."""
    hparams = dict(getattr(module, "hparams", None) or {})
    data_hparams = getattr(getattr(trainer, "datamodule", None), "hparams", None) or {}
    precision = getattr(trainer, "precision", None)
    return Workload(
        num_generations=hparams.get("num_generations"),
        prompts_per_iteration=data_hparams.get("batch_size"),
        max_new_tokens=hparams.get("max_new_tokens"),
        micro_batch_size=getattr(module, "micro_batch_size", hparams.get("micro_batch_size")),
        precision=None if precision is None else str(precision),
        engine=options.engine,
        engine_kwargs=dict(options.engine_kwargs or {}),
        groups_per_call=options.groups_per_call,
        training={k: hparams[k] for k in TRAINING_HPARAMS if k in hparams},
        lend_idle_cores=lend_idle_cores,
    )


@dataclass(frozen=True)
class CachedSplit:
    """One remembered choice: the split (its ``predicted_s`` the seconds per iteration the
    fitted model expects), the fitted model's knobs, the rates of each measured window, and
    when it was chosen (ISO date)."""

    split: Candidate
    model: SplitModel
    windows: tuple[MeasuredRates, ...]
    date: str

    def describe(self) -> str:
        return f"{self.split.label} ({self.split.predicted_s:.3g} s/iteration predicted)"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CachedSplit:
        """The inverse of :meth:`to_json`; KeyError, TypeError or ValueError if malformed."""
        split = data["split"]
        candidate = Candidate(
            bool(split["overlap"]),
            tuple(int(c) for c in split["trainer_cores"]),
            tuple(tuple(int(c) for c in cores) for cores in split["worker_cores"]),
            float(split["predicted_s"]),
        )
        windows = tuple(
            MeasuredRates(**(w | {k: SideTime(**w[k]) for k in ("generation", "training")}))
            for w in data["windows"]
        )
        return cls(candidate, SplitModel(**data["model"]), windows, str(data["date"]))


def cache_path() -> Path:
    """``$PERIODIC_RL_SPLIT_CACHE``, else ``hardware_split.json`` in the project's cache
    directory (``$PERIODIC_RL_CACHE`` or ``~/.cache/periodic_rl``)."""
    from periodic_rl.models import cache_dir

    return Path(os.environ.get(CACHE_ENV) or cache_dir() / "hardware_split.json")


def cache_key(
    cores: Sequence[int], num_workers: int, model_path: str, workload: Workload
) -> dict[str, Any]:
    """What the best split depends on: the CPU model, the core ids split, the workers, the
    model's shape, the workload and the versions of periodic_rl, torch and vLLM (JSON values
    only: anything else in the workload is written as its ``str``)."""
    try:
        shape = model_shape(model_path)
    except (OSError, ValueError):  # not a readable config: the path stands for the model
        shape = {"path": model_path}
    key = {
        "format": _FORMAT,
        "cpu": cpu_fields().get("model name", "unknown"),
        "cores": [int(c) for c in cores],
        "num_workers": num_workers,
        "model": shape,
        "workload": asdict(workload),
        "versions": {m: package_version(m) for m in ("periodic_rl", "torch", "vllm")},
    }
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def read_cache(path: Path, key: dict[str, Any]) -> CachedSplit | None:
    """``key``'s remembered split, or None (no file, no entry, an unreadable file or entry)."""
    entry = read_entry(path, key, "hardware split")
    if entry is None:
        return None
    try:
        return CachedSplit.from_json(entry["choice"])
    except (KeyError, TypeError, ValueError) as error:
        log.warning("hardware split cache %s: an unreadable entry (%r); ignoring it", path, error)
        return None


def write_cache(path: Path, key: dict[str, Any], choice: CachedSplit) -> None:
    """Add (or replace) ``key``'s entry: written to a temporary file in the same folder, then
    renamed over the cache, so a reader never sees half a file."""
    write_entry(path, key, {"key": key, "choice": choice.to_json()}, "hardware split")


@dataclass(frozen=True)
class SplitCache:
    """One run's place in the cache: the file, its key and what the file held for it at the
    start (``hit``; ``None``: explore, then :meth:`remember`)."""

    path: Path
    key: dict[str, Any]
    hit: CachedSplit | None

    @classmethod
    def open(
        cls,
        cores: Sequence[int],
        num_workers: int,
        model_path: str,
        workload: Workload,
        path: Path | None = None,
    ) -> SplitCache:
        """Look the run up (``path``: default :func:`cache_path`)."""
        path = path or cache_path()
        key = cache_key(cores, num_workers, model_path, workload)
        return cls(path, key, read_cache(path, key))

    def remember(self, step: SplitStep, windows: Sequence[MeasuredRates]) -> CachedSplit | None:
        """Write an explored run's final choice (``step.plan.chosen``, with the fitted model
        and the measured windows). A cache that cannot be written costs a warning only."""
        if step.plan is None:
            return None
        choice = CachedSplit(
            step.plan.chosen,
            step.model or SplitModel(),
            tuple(windows),
            datetime.now().astimezone().isoformat(timespec="seconds"),
        )
        try:
            write_cache(self.path, self.key, choice)
        except OSError as error:
            log.warning("hardware split: could not remember the choice in %s: %s", self.path, error)
            return None
        return choice

    def check(self, step: SplitStep) -> bool:
        """Whether the cached split ran as predicted: a measured iteration more than
        :data:`SLOWER_MARGIN` slower than the cached prediction is warned about (False)."""
        if self.hit is None or step.rates.wall_s is None:
            return True
        expected = self.hit.split.predicted_s
        if step.rates.wall_s <= (1 + SLOWER_MARGIN) * expected:
            return True
        log.warning(
            "hardware split: the cached split (%s, chosen %s) measured %.3g s per iteration, "
            "more than %.0f%% slower than predicted; the machine or the workload may have "
            "changed. To explore again, delete %s (or set %s to another file).",
            self.hit.split.label, self.hit.date, step.rates.wall_s, SLOWER_MARGIN * 100,
            self.path, CACHE_ENV,
        )  # fmt: skip
        return False
