"""What a row of ``tests/mutations.py`` is, and the test files many rows name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """One promise broken on purpose: replace ``old`` (which must occur exactly once in
    ``file``) by ``new``; the pytest node ids ``tests`` must then fail."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


STRATEGY_TESTS = "tests/strategies/test_periodic_async.py"
DISTRIBUTED_TESTS = "tests/strategies/test_distributed.py"
STALENESS_TESTS = "tests/strategies/test_staleness.py"
