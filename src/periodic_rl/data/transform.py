"""What happens to each loaded row before it is checked: the column mapping, then the user's
preprocessing function.

``columns`` renames dataset columns to the names the library and the rewards see
(``{"question": "prompt", "answer": "solution"}``); columns it does not name keep theirs.
``preprocess`` (a callable, or ``"package.module:function"``) takes one row dict, after the
mapping, and returns the row dict to use; it is resolved when the data module is built, so a
bad path fails before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from periodic_rl.dotted import import_dotted

Row = dict[str, Any]
Preprocess = Callable[[Row], Row]


def resolve_preprocess(spec: str | Preprocess | None) -> Preprocess | None:
    """A callable, from itself or from ``package.module:function`` (or ``pkg.module.func``)."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"preprocess must be a callable or 'package.module:function', got {type(spec).__name__}"
        )
    try:
        func = import_dotted(spec)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"preprocess: cannot import {spec!r} ({type(error).__name__}: {error}); give "
            "'package.module:function' of an importable module (on PYTHONPATH) whose function "
            "takes a row dict and returns a row dict"
        ) from error
    if not callable(func):
        raise ValueError(f"preprocess: {spec!r} is a {type(func).__name__}, not a function")
    return func


def check_column_mapping(columns: Mapping[str, str] | None) -> None:
    """Refuse a mapping with a non-string entry or two columns mapped to one name."""
    if not columns:
        return
    for key, value in columns.items():
        if not isinstance(key, str) or not isinstance(value, str) or not value:
            raise ValueError(
                f"columns: {key!r}: {value!r} is not 'dataset column': 'new name' (two strings)"
            )
    targets = list(columns.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise ValueError(
            f"columns maps several dataset columns to {twice}; each name can come from one column"
        )


@dataclass(frozen=True)
class RowTransform:
    """The column mapping and the preprocessing function of a data module (both optional)."""

    columns: Mapping[str, str] = field(default_factory=dict)
    preprocess: Preprocess | None = None

    def __post_init__(self) -> None:
        check_column_mapping(self.columns)

    def apply(self, rows: list[Row], names: list[str], source: str) -> list[Row]:
        """``rows`` (whose columns are ``names``) renamed, then preprocessed, in order."""
        if self.columns and rows:
            self._check_mapping(names, source)
            rows = [self._renamed(row) for row in rows]
        if self.preprocess is not None:
            rows = [self._preprocessed(row, i, source) for i, row in enumerate(rows)]
        return rows

    def _check_mapping(self, names: list[str], source: str) -> None:
        missing = [key for key in self.columns if key not in names]
        if missing:
            raise ValueError(
                f"{source}: columns maps {missing}, which it does not have (its columns: "
                f"{names}); change the mapping's keys to the dataset's own column names"
            )
        kept = set(names) - set(self.columns)
        clash = sorted(kept & set(self.columns.values()))
        if clash:
            raise ValueError(
                f"{source}: columns renames a column to {clash}, a column it already has; map "
                f"that column too (e.g. {{{clash[0]!r}: 'original_{clash[0]}'}}) or choose "
                "another name"
            )

    def _renamed(self, row: Row) -> Row:
        return {self.columns.get(key, key): value for key, value in row.items()}

    def _preprocessed(self, row: Row, index: int, source: str) -> Row:
        name = getattr(self.preprocess, "__name__", repr(self.preprocess))
        try:
            out = self.preprocess(dict(row))
        except Exception as error:
            raise ValueError(
                f"preprocess {name} failed on row {index} of {source} ({type(error).__name__}: "
                f"{error}); the row was {_short(row)}"
            ) from error
        if not isinstance(out, dict):
            raise ValueError(
                f"preprocess {name} returned a {type(out).__name__} for row {index} of {source}; "
                "it must return the row as a dict (e.g. `return {**row, 'prompt': ...}`)"
            )
        return out


def _short(row: Row) -> str:
    text = repr(row)
    return text if len(text) <= 200 else text[:200] + "..."
