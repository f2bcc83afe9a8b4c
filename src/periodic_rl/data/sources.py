"""Loading prompt rows from a built-in task, a `reasoning-gym` task, a JSONL/Parquet file, or a
`datasets` source (:mod:`periodic_rl.data.hub`: a hub id with its config, a local hub-format
repository, a ``save_to_disk`` directory). Every row goes through the column mapping and the
preprocessing function (:mod:`periodic_rl.data.transform`) before it is checked.

The held-out rows never overlap the training rows. They come from, in this order:

1. ``val_source``, when given;
2. the ``val_split`` of a hub dataset (or dataset directory), when it has that split and it is
   not the training ``split``;
3. otherwise a seeded fraction carved out of the training rows (``val_fraction``, at most
   ``num_val`` prompts); the carved rows are removed from training. A single file (or a single
   saved ``Dataset``) has no splits, so a ``.jsonl``/``.json``/``.parquet`` ``source`` is always
   carved.

Built-in and `reasoning-gym` tasks generate their own held-out rows, disjoint by construction.

Rows are compared by prompt: every row whose prompt is held out leaves training (duplicated
prompts go together), and rows of a ``val_source`` or ``val_split`` whose prompt is also a
training prompt are dropped from the held-out set. Which rule was used, and how many rows, is
logged once (rank zero).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from periodic_rl.data import arithmetic, reasoning_gym
from periodic_rl.data.checks import check_rows, check_same_columns
from periodic_rl.data.hub import HubOptions, has_no_splits, is_file, load_split
from periodic_rl.data.transform import RowTransform

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
    val_fraction: float = 0.1,
    seed: int = 0,
    prompt_column: str = "prompt",
    hub: HubOptions | None = None,
    transform: RowTransform | None = None,
) -> PromptSource:
    """Resolve ``source`` into rows; every row gets its prompt under the key ``"prompt"``.

    See the module docstring for where the held-out rows come from. ``val_fraction`` is only
    used when carving (``0``: no held-out set); ``num_val`` caps the held-out rows in every case
    (``0``: no held-out set). ``hub`` (config name, data files, revision) applies to ``source``,
    and to ``val_source`` only when it is the same dataset.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    hub = hub or HubOptions()
    transform = transform or RowTransform()
    if source.startswith("builtin:"):
        task = _builtin(source.removeprefix("builtin:"), num_train, num_val, seed)
        return _transformed(task, source, transform)
    if source.startswith(reasoning_gym.PREFIX):
        return _transformed(_gym_task(source, num_train, num_val, seed), source, transform)
    train = _rows(source, split, prompt_column, hub, transform)
    if val_source is not None:
        _check_not_same(source, split, val_source, val_split)
        val_hub = hub if val_source == source else HubOptions()
        val = _rows(val_source, val_split, prompt_column, val_hub, transform)
        what = f"val_source {val_source}"
        what += "" if has_no_splits(val_source, val_hub) else f" (split '{val_split}')"
        check_same_columns(val, train, what, source)
        val = _disjoint(val, train, num_val, what)
        return PromptSource(train=train, val=val)
    if not has_no_splits(source, hub) and val_split != split:
        try:
            dataset = load_split(source, val_split, hub)
        except (KeyError, ValueError):  # no such split: carve instead
            dataset = None
        if dataset is not None:
            val = _to_rows(dataset, source, prompt_column, transform)
            check_rows(val, f"{source} (split '{val_split}')", prompt_column=prompt_column)
            check_same_columns(val, train, f"split '{val_split}' of {source}", source)
            val = _disjoint(val, train, num_val, f"split '{val_split}' of {source}")
            return PromptSource(train=train, val=val)
    name = source
    if not has_no_splits(source, hub):
        why = "val_split is the training split" if val_split == split else f"no split '{val_split}'"
        name = f"{source} ({why})"
    train, val = carve(train, val_fraction=val_fraction, num_val=num_val, seed=seed, name=name)
    return PromptSource(train=train, val=val)


def carve(
    rows: list[dict[str, Any]],
    *,
    val_fraction: float,
    num_val: int,
    seed: int,
    name: str = "source",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``rows`` into (train, held-out) by prompt, seeded and disjoint.

    ``ceil(val_fraction * prompts)`` distinct prompts, at most ``num_val``, are held out: those
    whose hash with ``seed`` is smallest. Each held-out prompt appears once in the held-out rows
    (its first row); every row with a held-out prompt leaves training. Both lists keep the file
    order, so the same rows and seed always give the same split (a resumed run trains on the
    same list).
    """
    first: dict[str, int] = {}
    keys = []
    for i, row in enumerate(rows):
        key = prompt_key(row["prompt"])
        keys.append(key)
        first.setdefault(key, i)
    want = min(num_val, math.ceil(val_fraction * len(first)))
    if want <= 0:
        reason = "val_fraction=0" if val_fraction == 0 else f"num_val={num_val}"
        rank_zero_info(f"held-out: none ({reason}); {len(rows)} rows for training")
        return list(rows), []
    if want >= len(first):
        raise ValueError(
            f"{name}: {len(first)} distinct prompts; holding out {want} of them "
            f"(val_fraction={val_fraction}) leaves none for training. Lower val_fraction "
            "(0: no held-out set) or give a val_source"
        )
    ranked = sorted(first, key=lambda key: (_rank(seed, key), key))
    held = set(ranked[:want])
    val = [rows[i] for i in sorted(first[key] for key in held)]
    train = [row for row, key in zip(rows, keys, strict=True) if key not in held]
    rank_zero_info(
        f"held-out: {len(val)} rows carved from {name} (val_fraction={val_fraction}, "
        f"seed {seed}), {len(train)} rows left for training"
    )
    return train, val


def prompt_key(prompt: Any) -> str:
    """A prompt (a string or chat messages) as a string that is equal for equal prompts."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


def _rank(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()


def _disjoint(
    val: list[dict[str, Any]], train: list[dict[str, Any]], num_val: int, what: str
) -> list[dict[str, Any]]:
    """``val`` without the rows whose prompt is a training prompt, at most ``num_val`` rows."""
    seen = {prompt_key(row["prompt"]) for row in train}
    kept = [row for row in val if prompt_key(row["prompt"]) not in seen]
    if len(kept) < len(val):
        rank_zero_warn(
            f"held-out: {len(val) - len(kept)} of {len(val)} rows of {what} have a prompt that "
            "is also a training prompt; they are left out of the held-out set"
        )
    kept = kept[: max(num_val, 0)]
    rank_zero_info(f"held-out: {len(kept)} rows from {what}; {len(train)} rows for training")
    return kept


def _check_not_same(source: str, split: str, val_source: str, val_split: str) -> None:
    """Refuse a ``val_source`` that would hand back the training rows."""
    if is_file(source) and is_file(val_source):
        if Path(source).resolve() == Path(val_source).resolve():
            raise ValueError(
                f"val_source {val_source} is the training file itself; a single file has no "
                "splits (val_split does not select rows of it). Leave val_source unset to carve "
                "a held-out fraction out of it (val_fraction), or give a separate file"
            )
    elif source == val_source and split == val_split:
        raise ValueError(
            f"val_source {val_source} with val_split '{val_split}' is the training split "
            f"itself; set val_split to another split of it, or leave val_source unset"
        )


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


def _gym_task(source: str, num_train: int, num_val: int, seed: int) -> PromptSource:
    task = source.removeprefix(reasoning_gym.PREFIX)
    train, val = reasoning_gym.train_and_val(task, num_train, num_val, seed)
    return PromptSource(
        train=train,
        val=val,
        reward_funcs=[reasoning_gym.TaskVerifier(task)],
        reward_weights=[1.0],
        accuracy_func=reasoning_gym.TaskVerifier(task, exact=True),
    )


def _transformed(task: PromptSource, source: str, transform: RowTransform) -> PromptSource:
    """A generated task's rows through the column mapping and the preprocessing, checked."""
    if not transform.columns and transform.preprocess is None:
        return task
    task.train = transform.apply(task.train, list(task.train[0]), source)
    check_rows(task.train, source)
    if task.val:
        task.val = transform.apply(task.val, list(task.val[0]), f"{source} (held-out)")
        check_rows(task.val, f"{source} (held-out)")
        check_same_columns(task.val, task.train, f"the held-out rows of {source}", source)
    return task


def _check_exists(source: str) -> None:
    if not Path(source).is_file():
        raise FileNotFoundError(f"prompt file {source} does not exist")


def read_json_rows(source: str) -> tuple[list[dict[str, Any]], list[int] | None]:
    """The rows of a ``.jsonl`` (or ``.json``) file and the line each row is on: a JSON array
    of objects (lines: None), or one JSON object per line (blank lines skipped). A line that
    is not a JSON object is refused with its line number; so is a file without rows."""
    _check_exists(source)
    text = Path(source).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"no rows in {source}: the file is empty; give at least one JSON row")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None  # not one JSON array: read it line by line for a line number
        if isinstance(items, list):
            for k, item in enumerate(items):
                if not isinstance(item, dict):
                    raise ValueError(
                        f"{source}: item {k} of the JSON array is a {type(item).__name__}, "
                        "not an object; every row is a JSON object such as "
                        '{"prompt": "..."}'
                    )
            if not items:
                raise ValueError(f"no rows in {source}: the JSON array is empty")
            return items, None
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{source}:{number}: line {number} is not valid JSON ({error.msg}, column "
                f"{error.colno}): {line[:80]!r}; each line must be one JSON object such as "
                '{"prompt": "..."}: fix or remove that line'
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{source}:{number}: line {number} is a JSON {type(row).__name__}, not an "
                'object; each line must be one JSON object such as {"prompt": "..."}'
            )
        rows.append(row)
        lines.append(number)
    return rows, lines


def _to_rows(
    dataset: Any, source: str, prompt_column: str, transform: RowTransform
) -> list[dict[str, Any]]:
    rows = transform.apply([dict(row) for row in dataset], dataset.column_names, source)
    return _renamed(rows, _names(rows, dataset.column_names, transform), source, prompt_column)


def _names(rows: list[dict[str, Any]], names: list[str], transform: RowTransform) -> list[str]:
    """The column names after the transform: the first row's, when there is one."""
    if transform.preprocess is not None or transform.columns:
        return list(rows[0]) if rows else names
    return names


def _renamed(
    rows: list[dict[str, Any]], columns: list[str], source: str, prompt_column: str
) -> list[dict[str, Any]]:
    """The rows with their prompt under ``"prompt"``."""
    if rows and prompt_column not in columns:
        raise ValueError(
            f"{source}: no '{prompt_column}' column (columns: {columns}); "
            "add one, or set `prompt_column` to the column that holds the prompt"
        )
    for row in rows:
        row["prompt"] = row.pop(prompt_column, None)
    return rows


def _rows(
    source: str, split: str, prompt_column: str, hub: HubOptions, transform: RowTransform
) -> list[dict[str, Any]]:
    """The rows of ``source``, mapped, preprocessed and every one checked
    (:func:`periodic_rl.data.checks.check_rows`)."""
    lines = None
    if is_file(source) and not source.endswith(".parquet"):
        if hub.data_files is not None:
            raise ValueError(
                f"data_files is for a hub dataset, a dataset directory or a builder such as "
                f"'json'; the single file {source} takes none: remove data_files (or give "
                "source: json with data_files: {train: [...], test: [...]})"
            )
        rows, lines = read_json_rows(source)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        rows = transform.apply(rows, columns, source)
        columns = _names(rows, columns, transform)
        rows = _renamed(rows, columns, source, prompt_column)
    else:
        dataset = load_split(source, split, hub)
        rows = _to_rows(dataset, source, prompt_column, transform)
    check_rows(rows, source, prompt_column=prompt_column, lines=lines)
    return rows
