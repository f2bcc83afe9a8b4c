"""Local stand-ins for hub datasets: a script-free hub-format repository with two configs,
written as the hub lays them out, and a module of user functions on ``sys.path``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from data_helpers import README, question_rows, write_jsonl


@pytest.fixture
def hub_repo(tmp_path) -> Path:
    """``main`` (train: 12 rows, test: 4) and ``socratic`` (train only: 10 rows)."""
    repo = tmp_path / "toy_gsm8k"
    write_jsonl(repo / "main" / "train.jsonl", question_rows("main", "train", 12))
    write_jsonl(repo / "main" / "test.jsonl", question_rows("main", "test", 4))
    write_jsonl(repo / "socratic" / "train.jsonl", question_rows("socratic", "train", 10))
    (repo / "README.md").write_text(README)
    return repo


USER_MODULE = '''
def add_hint(row):
    """A user's preprocessing: builds the prompt from two columns."""
    return {**row, "prompt": row["prompt"] + " Reply with only the number.", "hint": "add"}


def not_a_row(row):
    return [row]


def exact(prompts, completions, solution, **columns):
    """A reward that reads the mapped column ``solution``; refuses prompts of another config."""
    for prompt in prompts:
        if not prompt.startswith("socratic train"):
            raise ValueError(f"a prompt from the wrong config or split: {prompt!r}")
    return [float(c.strip() == s) for c, s in zip(completions, solution)]

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """The name of an importable module holding a user's functions (``add_hint``, ...)."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "toy_user_functions.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(folder))
    return "toy_user_functions"
