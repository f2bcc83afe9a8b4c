"""The checks every prompt row passes when it is loaded, so that a bad row fails before any
model loads or engine starts, naming the row, the file and the fix.

A row is a dict with a ``"prompt"`` (after ``prompt_column`` was renamed) and any further
columns, which reach the reward functions as keyword lists. The prompt is a non-empty string, or
a non-empty list of chat messages ``{"role": ..., "content": "..."}`` with a role of
:data:`ROLES` and string content. Every row has the same columns as the first row: a reward
receives each row's columns, and a row without one fails the reward call mid-run. A ``null``
value is a value (a hub dataset's optional column holds nulls; the reward sees ``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The chat roles a prompt message may have.
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

_PROMPT_FIX = (
    "a prompt is a non-empty string or a non-empty list of chat messages "
    '[{"role": "user", "content": "..."}]'
)


def row_name(index: int, source: str, lines: Sequence[int] | None = None) -> str:
    """``row 3 of data.jsonl (line 5)``: rows count from 0 in file order."""
    where = f"row {index} of {source}"
    if lines is not None and index < len(lines):
        where += f" (line {lines[index]})"
    return where


def check_prompt(prompt: Any, where: str, prompt_column: str = "prompt") -> None:
    """Refuse a prompt that is not a non-empty string or a list of well-formed chat messages."""
    column = f"'{prompt_column}'"
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the prompt ({column}) is empty; {_PROMPT_FIX}")
        return
    if not isinstance(prompt, list):
        raise ValueError(
            f"{where}: the prompt ({column}) is {prompt!r:.60}, of type {type(prompt).__name__}; "
            f"{_PROMPT_FIX}"
        )
    if not prompt:
        raise ValueError(f"{where}: the prompt ({column}) is an empty list of messages; "
                         f"{_PROMPT_FIX}")  # fmt: skip
    for k, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}: message {k} of the prompt is {message!r:.80}, not a "
                '{"role": ..., "content": ...} dict; ' + _PROMPT_FIX
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}: message {k} of the prompt has role {message['role']!r}; a role is "
                f"one of {list(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(
                f"{where}: message {k} of the prompt has content of type "
                f"{type(message['content']).__name__}; give the content as a string"
            )


def check_rows(
    rows: Sequence[dict[str, Any]],
    source: str,
    *,
    prompt_column: str = "prompt",
    lines: Sequence[int] | None = None,
) -> None:
    """Refuse an empty row list, a row without a valid prompt, and a row whose columns differ
    from the first row's (a column missing from one of them). ``rows`` have their
    prompt under ``"prompt"``; ``lines``: each row's line in a JSON-lines file, for messages."""
    if not rows:
        raise ValueError(f"no rows in {source}: give a file (or split) with at least one row")
    first = _columns(rows[0])
    for i, row in enumerate(rows):
        where = row_name(i, source, lines)
        if row.get("prompt") is None:
            raise ValueError(
                f"{where} has no prompt (no '{prompt_column}', or null); every row needs one "
                "(or set prompt_column to the column that holds the prompt)"
            )
        check_prompt(row["prompt"], where, prompt_column)
        columns = _columns(row)
        if columns != first:
            missing, extra = sorted(first - columns), sorted(columns - first)
            what = (
                f"has no column {missing[0]!r}"
                if missing
                else f"has column {extra[0]!r}, which row 0 does not have"
            )
            raise ValueError(
                f"{where} {what} (row 0 has {sorted(first)}): the reward functions receive "
                "each row's columns, so every row needs the same ones; add the value to every "
                "row (or remove the column from all of them)"
            )


def check_same_columns(
    rows: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], what: str, ref: str
) -> None:
    """Refuse held-out rows (``what``) whose columns differ from the training rows' (``ref``):
    the rewards score both."""
    if not rows or not reference:
        return
    got, want = _columns(rows[0]), _columns(reference[0])
    if got != want:
        raise ValueError(
            f"the rows of {what} have columns {sorted(got)}, the training rows of {ref} "
            f"{sorted(want)}: the rewards score both, so give them the same columns"
        )


def _columns(row: dict[str, Any]) -> set[str]:
    return {k for k in row if k != "prompt"}
