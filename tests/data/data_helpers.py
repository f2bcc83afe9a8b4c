"""Rows and files for the data tests: a hub-format repository's README and its rows."""

from __future__ import annotations

import json
from pathlib import Path

README = """\
---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
# A toy dataset in the layout of openai/gsm8k: two configs, `question` and `answer` columns.
"""


def question_rows(config: str, split: str, count: int) -> list[dict[str, str]]:
    """``{"question", "answer"}`` rows whose question names its config and split."""
    return [
        {"question": f"{config} {split}: what is {i} + 1?", "answer": str(i + 1)}
        for i in range(count)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
