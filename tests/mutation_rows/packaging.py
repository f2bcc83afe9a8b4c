"""Rows for the first-day work: packaging."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = []
