"""A reward that runs the completion's code against the row's tests in :mod:`periodic_rl.sandbox`.

The dataset needs a ``tests`` column: per row, a list of Python statements such as
``"assert add(2, 3) == 5"`` (a JSON string of such a list also works). The completion's last
```` ```python ```` block is the solution (no block scores 0); the reward is the fraction of tests
it passes, each run with a CPU, memory, wall-clock and output limit and no network. From YAML,
with ``PYTHONPATH=examples`` like ``examples/math_jsonl.yaml``::

    model:
      init_args:
        reward_funcs: [code_reward:passes_tests]
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from periodic_rl.sandbox import run_tests

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
LIMITS = {"timeout_s": 10.0, "cpu_s": 5, "memory_mb": 512}


def extract_code(completion: str) -> str | None:
    """The last fenced code block of ``completion``, or ``None``."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def _score(completion: str, tests: list[str] | str) -> float:
    code = extract_code(completion)
    tests = json.loads(tests) if isinstance(tests, str) else list(tests)
    return 0.0 if code is None or not tests else run_tests(code, tests, **LIMITS)


def passes_tests(
    prompts: list[Any], completions: list[str], tests: list[Any], **columns: Any
) -> list[float]:
    """The fraction of its row's ``tests`` each completion's code passes (0 without code)."""
    with ThreadPoolExecutor(max_workers=4) as pool:  # each run is a subprocess: threads suffice
        return list(pool.map(_score, completions, tests))
