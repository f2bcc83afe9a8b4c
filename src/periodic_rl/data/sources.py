"""Loading prompt rows from a built-in task, a JSONL/Parquet file, or a `datasets` hub id."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from periodic_rl.data import arithmetic

RewardFunc = Any  # a callable (prompts, completions, **columns) -> list[float]


@dataclass
class PromptSource:
    """Rows for training and evaluation, plus the task's own rewards when it has them."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    reward_funcs: list[RewardFunc] = field(default_factory=list)
    reward_weights: list[float] | None = None
    accuracy_func: RewardFunc | None = None


def load_source(
    source: str,
    *,
    val_source: str | None = None,
    split: str = "train",
    val_split: str = "test",
    num_train: int = 4096,
    num_val: int = 64,
    seed: int = 0,
    prompt_column: str = "prompt",
) -> PromptSource:
    """Resolve ``source`` into rows; every row gets its prompt under the key ``"prompt"``."""
    if source.startswith("builtin:"):
        return _builtin(source.removeprefix("builtin:"), num_train, num_val, seed)
    train = _rows(source, split, prompt_column)
    if val_source is not None:
        val = _rows(val_source, val_split, prompt_column)
    else:
        try:
            val = _rows(source, val_split, prompt_column)
        except (KeyError, ValueError):
            val = []
    return PromptSource(train=train, val=val[:num_val])


def _builtin(name: str, num_train: int, num_val: int, seed: int) -> PromptSource:
    if name != "arithmetic":
        raise ValueError(f"unknown built-in task 'builtin:{name}'; available: 'builtin:arithmetic'")
    return PromptSource(
        train=arithmetic.arithmetic_problems("train", num_train, seed=seed),
        val=arithmetic.arithmetic_problems("test", num_val, seed=seed),
        reward_funcs=list(arithmetic.REWARD_FUNCS),
        reward_weights=list(arithmetic.REWARD_WEIGHTS),
        accuracy_func=arithmetic.ACCURACY_FUNC,
    )


def _rows(source: str, split: str, prompt_column: str) -> list[dict[str, Any]]:
    import datasets

    path = Path(source)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        if not path.exists():
            raise FileNotFoundError(f"prompt file {source} does not exist")
        builder = "parquet" if path.suffix == ".parquet" else "json"
        dataset = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    else:
        dataset = datasets.load_dataset(source, split=split)
    if prompt_column not in dataset.column_names:
        raise ValueError(
            f"{source}: no '{prompt_column}' column (columns: {dataset.column_names}); "
            "add one, or set `prompt_column` to the column that holds the prompt"
        )
    rows = []
    for row in dataset:
        row = dict(row)
        row["prompt"] = row.pop(prompt_column)
        rows.append(row)
    return rows
