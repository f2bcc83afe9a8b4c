"""Check the on-policy promise on a user's own configuration: the run as configured against a
reference run of the same configuration, seeds and data.

:func:`verify` trains the configuration (a ``periodic-rl fit`` YAML, or its dict) for a few
iterations twice, in a temporary folder, without its callbacks, loggers, held-out evaluation or
record: as configured, and in the reference mode, which takes the asynchrony away: with
``max_staleness: 0``, no overlap and one rollout worker; with ``k >= 1`` (whose schedule is the
same for any number of workers) the same schedule with another worker count. It compares what
the two trained: the parameters at the end (largest and mean absolute difference), each
iteration's groups (their completions, the policy version and weights fingerprint that
generated them), and the engine/trainer mismatch of each. The verdict: the runs agree when
every group is the same (version and completions; weights that differ only in their last bits,
as float summation order leaves them, have other fingerprints and are counted apart) and the
parameters are within ``tolerance``. A CPU tuner's core loans are off in both runs: they change
the trainer's thread count with timing, and so the last bits of its sums.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import Callback

from periodic_rl.callbacks._common import last_iteration

#: Largest parameter difference that float summation order explains.
TOLERANCE = 1e-5
DEFAULT_STRATEGY = "periodic_rl.PeriodicAsyncStrategy"

#: Per group index: its completions, the version and fingerprint that generated it.
GroupStamp = tuple[tuple[tuple[int, ...], ...], int, str]


class TrainedGroups(Callback):
    """Keeps, per iteration, what each group was (:data:`GroupStamp`) and the mismatch metrics."""

    def __init__(self) -> None:
        self.iterations: list[dict[int, GroupStamp]] = []
        self.mismatch: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        stats = last_iteration(pl_module)
        if stats is None:
            return
        self.iterations.append(
            {
                g.index: (tuple(map(tuple, g.completion_ids)), g.version, g.fingerprint)
                for g in stats.groups
            }
        )
        self.mismatch.append(stats.metrics().get("mismatch/abs_logp", float("nan")))


@dataclass
class RunResult:
    """What one run of :func:`verify` trained."""

    mode: str
    parameters: dict[str, torch.Tensor]
    groups: list[dict[int, GroupStamp]]
    mismatch: list[float]


@dataclass
class Verdict:
    """The comparison of the configured run with the reference run."""

    iterations: int
    tolerance: float
    configured: str
    reference: str
    max_difference: float
    mean_difference: float
    differing_groups: list[tuple[int, int, str]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    mismatch: list[tuple[float, float]] = field(default_factory=list)
    other_fingerprints: int = 0  # groups alike but for the weights' last bits

    @property
    def agree(self) -> bool:
        return not self.differing_groups and self.max_difference <= self.tolerance

    def table(self) -> str:
        rows = [
            ("runs", f"{self.configured}  vs  {self.reference}"),
            ("iterations", str(self.iterations)),
            ("parameters: max |difference|", f"{self.max_difference:.3e}"),
            ("parameters: mean |difference|", f"{self.mean_difference:.3e}"),
            ("groups that differ", str(len(self.differing_groups))),
            ("groups alike, weights apart in the last bits", str(self.other_fingerprints)),
            ("versions seen per iteration", "; ".join(str(v) for v in self.versions)),
        ]
        for i, (a, b) in enumerate(self.mismatch):
            rows.append((f"mismatch/abs_logp, iteration {i}", f"{a:.3g} vs {b:.3g}"))
        width = max(len(name) for name, _ in rows)
        lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
        for iteration, group, why in self.differing_groups[:10]:
            lines.append(f"iteration {iteration} group {group}: {why}")
        verdict = "AGREE" if self.agree else "DIFFER"
        lines.append(
            f"verdict: {verdict} (tolerance {self.tolerance:.0e} on the parameters, every group "
            "the same)"
        )
        return "\n".join(lines)


def load_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A ``periodic-rl fit`` configuration as a dict (a YAML file's path, or the dict)."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    loaded = yaml.safe_load(Path(config).read_text())
    if not isinstance(loaded, dict):
        raise ValueError(f"{config} is not a periodic-rl configuration (a YAML mapping)")
    return loaded


def _strategy(config: dict[str, Any]) -> dict[str, Any]:
    trainer = config.setdefault("trainer", {})
    strategy = trainer.get("strategy")
    if strategy is None:
        strategy = {"class_path": DEFAULT_STRATEGY, "init_args": {}}
    if not isinstance(strategy, dict) or "class_path" not in strategy:
        raise ValueError(
            f"verify needs trainer.strategy as class_path and init_args (got {strategy!r}): "
            "write it as in examples/arithmetic.yaml"
        )
    strategy.setdefault("init_args", {})
    trainer["strategy"] = strategy
    return strategy["init_args"]


def run_configs(
    config: Mapping[str, Any], iterations: int, root: Path
) -> tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]]]:
    """The configured and the reference run's configurations, ``iterations`` long, each in a
    folder of ``root``, without callbacks, loggers, checkpoints, evaluation or record."""
    runs = []
    for name in ("configured", "reference"):
        run = copy.deepcopy(dict(config))
        trainer = run.setdefault("trainer", {})
        model = run.setdefault("model", {})
        model_args = model.setdefault("init_args", {}) if isinstance(model, dict) else {}
        steps = int(model_args.get("num_iterations", 1))
        for key in ("callbacks", "val_check_interval", "check_val_every_n_epoch", "max_epochs"):
            trainer.pop(key, None)
        trainer.update(
            max_steps=iterations * steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            default_root_dir=str(root / name),
        )
        model_args.update(eval_at_start=False, eval_at_end=False, record_rollouts=False)
        strategy = _strategy(run)
        tuning = strategy.get("tuning")
        if isinstance(tuning, dict) and str(tuning.get("class_path", "")).endswith("CPUTuning"):
            # core loans change the trainer's thread count with timing, and so the last bits
            tuning.setdefault("init_args", {})["lend_idle_cores"] = False
        if name == "reference":
            workers = int(strategy.get("num_workers", 1))
            if int(strategy.get("max_staleness", 0)) == 0:
                strategy.update(overlap=False, num_workers=1)
            else:  # the schedule decides which version generates what: any worker count
                strategy.update(num_workers=2 if workers == 1 else 1)
        runs.append((describe(strategy), run))
    return runs[0], runs[1]


def describe(strategy: Mapping[str, Any]) -> str:
    """The asynchrony settings of a run, as the table names them."""
    return (
        f"overlap={strategy.get('overlap', True)}, num_workers={strategy.get('num_workers', 1)}"
        f", max_staleness={strategy.get('max_staleness', 0)}"
    )


def train(config: dict[str, Any], mode: str) -> RunResult:
    """Fit one configuration (through the CLI's own parser and classes). The process's cores
    and torch threads are given back afterwards: a CPU tuner pins the trainer to its cores,
    and the next run's strategy checks its cores against this process's."""
    from periodic_rl.cli_app import build_cli

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        cli = build_cli(config)
        kept = TrainedGroups()
        cli.trainer.callbacks.append(kept)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:  # every thread: a CPU tuner pins torch's too
        for thread in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(thread), cores)
            except OSError:  # the thread ended meanwhile
                continue
        torch.set_num_threads(threads)
    parameters = {
        name: p.detach().float().cpu().clone()
        for name, p in cli.model.policy.named_parameters()
        if p.requires_grad
    }
    return RunResult(mode, parameters, kept.iterations, kept.mismatch)


def compare(configured: RunResult, reference: RunResult, tolerance: float) -> Verdict:
    """The :class:`Verdict` of two runs."""
    diffs = [
        (configured.parameters[n] - reference.parameters[n]).abs()
        for n in reference.parameters
        if n in configured.parameters
    ]
    max_diff = max((d.max().item() for d in diffs), default=float("inf"))
    total = sum(d.sum().item() for d in diffs)
    count = sum(d.numel() for d in diffs)
    verdict = Verdict(
        iterations=len(reference.groups),
        tolerance=tolerance,
        configured=configured.mode,
        reference=reference.mode,
        max_difference=max_diff
        if set(configured.parameters) == set(reference.parameters)
        else float("inf"),
        mean_difference=total / max(count, 1),
    )
    if len(configured.groups) != len(reference.groups):
        verdict.differing_groups.append(
            (len(reference.groups), -1, f"{len(configured.groups)} iterations trained")
        )
    for i, (mine, theirs) in enumerate(zip(configured.groups, reference.groups, strict=False)):
        verdict.versions.append(sorted({stamp[1] for stamp in mine.values()}))
        for index in sorted(set(mine) | set(theirs)):
            a, b = mine.get(index), theirs.get(index)
            if a is None or b is None:
                verdict.differing_groups.append((i, index, "trained in one run only"))
            elif a[1] != b[1]:
                verdict.differing_groups.append((i, index, f"version {a[1]} vs {b[1]}"))
            elif a[0] != b[0]:
                verdict.differing_groups.append((i, index, "other completions"))
            elif a[2] != b[2]:  # the same version, weights apart in their last bits
                verdict.other_fingerprints += 1
    verdict.mismatch = list(zip(configured.mismatch, reference.mismatch, strict=False))
    return verdict


def verify(
    config: str | Path | Mapping[str, Any], iterations: int = 3, tolerance: float = TOLERANCE
) -> Verdict:
    """Train ``config`` as configured and in the reference mode for ``iterations`` iterations
    each, and compare (module docstring)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    loaded = load_config(config)
    with tempfile.TemporaryDirectory(prefix="periodic_rl_verify_") as folder:
        (mode, configured), (reference_mode, reference) = run_configs(
            loaded, iterations, Path(folder)
        )
        first = train(configured, mode)
        second = train(reference, reference_mode)
    return compare(first, second, tolerance)
