"""Rows for the first-day work: defaults."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = []
