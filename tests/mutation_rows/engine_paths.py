"""Rows for issue-37 work (engine_paths); filled in by its owner."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = []
