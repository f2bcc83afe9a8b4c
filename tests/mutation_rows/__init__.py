"""The rows of ``tests/mutations.py``, one module per part of the library (each under 500 lines).

To add a mutation, append a :class:`~mutation_rows.base.Mutation` to the module of the file it
breaks: ``old`` is copied verbatim from the file (whitespace included), ``tests`` are pytest node
ids relative to the repository root.
"""

from __future__ import annotations

from mutation_rows.agents import ROWS as AGENT_ROWS
from mutation_rows.architecture import ROWS as ARCHITECTURE_ROWS
from mutation_rows.asynchrony import ROWS as ASYNCHRONY_ROWS
from mutation_rows.base import Mutation
from mutation_rows.config import ROWS as CONFIG_ROWS
from mutation_rows.coverage import ROWS as COVERAGE_ROWS
from mutation_rows.data_sources import ROWS as DATA_SOURCES_ROWS
from mutation_rows.defaults import ROWS as DEFAULTS_ROWS
from mutation_rows.engine_paths import ROWS as ENGINE_PATHS_ROWS
from mutation_rows.gpu_check import ROWS as GPU_CHECK_ROWS
from mutation_rows.gpu_paths import ROWS as GPU_PATHS_ROWS
from mutation_rows.loggers import ROWS as LOGGERS_ROWS
from mutation_rows.packaging import ROWS as PACKAGING_ROWS
from mutation_rows.provenance import ROWS as PROVENANCE_ROWS
from mutation_rows.rewards import ROWS as REWARDS_ROWS
from mutation_rows.rollout import ROWS as ROLLOUT_ROWS
from mutation_rows.sandbox import ROWS as SANDBOX_ROWS
from mutation_rows.split import ROWS as SPLIT_ROWS
from mutation_rows.strategies import ROWS as STRATEGY_ROWS
from mutation_rows.training import ROWS as TRAINING_ROWS

MUTATIONS: list[Mutation] = [
    *TRAINING_ROWS,
    *AGENT_ROWS,
    *ROLLOUT_ROWS,
    *ASYNCHRONY_ROWS,
    *SPLIT_ROWS,
    *STRATEGY_ROWS,
    *ARCHITECTURE_ROWS,
    *PACKAGING_ROWS,
    *DATA_SOURCES_ROWS,
    *REWARDS_ROWS,
    *CONFIG_ROWS,
    *DEFAULTS_ROWS,
    *LOGGERS_ROWS,
    *GPU_PATHS_ROWS,
    *PROVENANCE_ROWS,
    *ENGINE_PATHS_ROWS,
    *SANDBOX_ROWS,
    *COVERAGE_ROWS,
    *GPU_CHECK_ROWS,
]

__all__ = ["MUTATIONS", "Mutation"]
