"""Rows for the first-day work: config."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = []
