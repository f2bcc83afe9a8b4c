"""`RolloutSamples`: what the policy actually wrote, next to what the rewards made of it.

Curves of mean reward hide the usual RL failures (a reward function that parses the wrong
number, a policy that learnt to game the format); a few raw completions with their per-function
rewards and advantages show them at once.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from periodic_rl.callbacks._common import finished_iteration, last_iteration, run_dir
from periodic_rl.rollout.types import RolloutGroup

TAG = "rollout_samples"


def sample_rows(
    groups: list[RolloutGroup], iteration: int, max_groups: int | None
) -> list[dict[str, Any]]:
    """One row per completion of the first ``max_groups`` groups (by group index)."""
    chosen = sorted(groups, key=lambda g: g.index)
    if max_groups is not None:
        chosen = chosen[:max_groups]
    rows = []
    for group in chosen:
        for i, completion in enumerate(group.completions):
            rows.append(
                {
                    "iteration": iteration,
                    "group": group.index,
                    "sample": i,
                    "prompt": group.prompt,
                    "completion": completion,
                    "reward": group.rewards[i],
                    "rewards": {k: v[i] for k, v in group.reward_components.items()},
                    "advantage": group.advantages[i] if group.advantages else None,
                    "version": group.version,
                    "worker": group.worker,
                    "columns": group.columns,
                }
            )
    return rows


def _text(value: Any) -> str:
    """A prompt as one string: plain text, or chat messages as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return json.dumps(value, default=str)


def _cell(value: Any, max_chars: int) -> str:
    """A Markdown table cell: no raw pipes or newlines, long text cut."""
    text = f"{value:.4g}" if isinstance(value, float) else _text(value)
    if len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def reward_names(rows: list[dict[str, Any]]) -> list[str]:
    """Per-function reward names in first-seen order."""
    return list(dict.fromkeys(name for row in rows for name in row["rewards"]))


def markdown_table(rows: list[dict[str, Any]], max_chars: int = 300) -> str:
    """The rows as a Markdown table; the prompt is shown once per group."""
    names = reward_names(rows)
    header = ["group", "prompt", "completion", "reward", *names, "advantage"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    previous = None
    for row in rows:
        prompt = "" if row["group"] == previous else _cell(row["prompt"], max_chars)
        previous = row["group"]
        cells = [
            str(row["group"]),
            prompt,
            _cell(row["completion"], max_chars),
            _cell(float(row["reward"]), max_chars),
            *(_cell(float(row["rewards"].get(n, float("nan"))), max_chars) for n in names),
            "" if row["advantage"] is None else _cell(float(row["advantage"]), max_chars),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flat_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and values for CSV files, W&B and MLflow tables (per-function rewards as
    columns)."""
    names = reward_names(rows)
    columns = ["iteration", "group", "sample", "prompt", "completion", "reward"]
    columns += [f"rewards/{n}" for n in names] + ["advantage", "version"]
    data = [
        [
            row["iteration"],
            row["group"],
            row["sample"],
            _text(row["prompt"]),
            row["completion"],
            row["reward"],
            *(row["rewards"].get(n) for n in names),
            row["advantage"],
            row["version"],
        ]
        for row in rows
    ]
    return columns, data


class RolloutSamples(Callback):
    """Every ``every_n_iterations`` iterations, log a table of prompts, completions, rewards
    and advantages, and append the same rows to a JSONL file.

    Each logger gets the table in its own format, at the step its rollouts' reward and other
    training metrics are logged at (the iteration's number, 0-based): TensorBoard a Markdown
    table (Text tab), W&B a ``wandb.Table`` under the key ``rollout_samples``, MLflow one
    table artifact ``rollout_samples.json`` that every logged iteration appends to (the run's
    Artifacts tab shows it as a table), a CSV logger ``rollout_samples.csv`` in its
    ``log_dir``; other loggers get none. The JSONL file (default
    ``<log_dir>/rollout_samples.jsonl``) is written whatever the loggers, one row per completion
    with ``iteration, group, sample, prompt, completion, reward, rewards`` (per function),
    ``advantage, version, worker, columns`` (the data row's other columns).

    Args:
        every_n_iterations: log iterations 0, N, 2N, ... (0-based, as the timing spans count).
        max_groups: prompt groups per table (the first ones by group index).
        jsonl_path: where to append the rows (default under the run's log folder).
        max_chars: characters of a prompt or completion shown in a Markdown cell (the JSONL and
            CSV files keep the whole text).
    """

    def __init__(
        self,
        every_n_iterations: int = 10,
        max_groups: int = 4,
        jsonl_path: str | None = None,
        max_chars: int = 300,
    ) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.every_n_iterations = every_n_iterations
        self.max_groups = max_groups
        self.jsonl_path = jsonl_path
        self.max_chars = max_chars
        self.logged_iterations: list[int] = []

    def resolve_jsonl_path(self, trainer: Any) -> Path:
        """The JSONL file this run appends to."""
        if self.jsonl_path is not None:
            return Path(self.jsonl_path)
        return run_dir(trainer) / f"{TAG}.jsonl"

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = last_iteration(pl_module)
        iteration = finished_iteration(trainer)
        if stats is None or not stats.groups or iteration % self.every_n_iterations:
            return
        if not trainer.is_global_zero:
            return
        rows = sample_rows(stats.groups, iteration, self.max_groups)
        self._append_jsonl(self.resolve_jsonl_path(trainer), rows)
        for logger in trainer.loggers:
            self._log(logger, rows, step=iteration)
        self.logged_iterations.append(iteration)

    @staticmethod
    def _append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")

    def _log(self, logger: Any, rows: list[dict[str, Any]], step: int) -> None:
        if isinstance(logger, TensorBoardLogger):
            text = markdown_table(rows, self.max_chars)
            logger.experiment.add_text(TAG, text, global_step=step)
        elif isinstance(logger, WandbLogger):
            columns, data = flat_rows(rows)
            logger.log_table(key=TAG, columns=columns, data=data, step=step)
        elif isinstance(logger, MLFlowLogger):
            columns, data = flat_rows(rows)
            table = {name: [values[i] for values in data] for i, name in enumerate(columns)}
            logger.experiment.log_table(logger.run_id, data=table, artifact_file=f"{TAG}.json")
        elif isinstance(logger, CSVLogger):
            _append_csv(Path(logger.log_dir) / f"{TAG}.csv", rows)


def _append_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append to a CSV file, keeping the header it was started with (new columns are dropped)."""
    columns, data = flat_rows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = None
    if path.exists() and path.stat().st_size > 0:
        with path.open(newline="", encoding="utf-8") as f:
            existing = next(csv.reader(f), None)
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if existing is None:
            writer.writerow(columns)
            existing = columns
        index = {name: i for i, name in enumerate(columns)}
        for values in data:
            writer.writerow([values[index[c]] if c in index else "" for c in existing])
