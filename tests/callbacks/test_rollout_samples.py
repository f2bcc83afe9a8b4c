"""RolloutSamples: the JSONL rows, the TensorBoard Markdown table and the CSV logger's file."""

from __future__ import annotations

import csv
import json

from callback_runs import STEPS

from periodic_rl.callbacks.samples import markdown_table, sample_rows
from periodic_rl.rollout.types import RolloutGroup

FIELDS = {"iteration", "group", "prompt", "completion", "reward", "rewards", "advantage", "version"}


def _jsonl(run):
    path = run.callbacks["RolloutSamples"].resolve_jsonl_path(run.trainer)
    assert path == run.root / "tb" / "version_0" / "rollout_samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_has_one_row_per_completion_with_the_fields(full_run):
    rows = _jsonl(full_run)
    assert len(rows) == STEPS * 4  # one group of G=4 per iteration
    assert [r["iteration"] for r in rows[::4]] == list(range(STEPS))
    for row in rows:
        assert FIELDS <= row.keys()
        assert row["version"] == row["iteration"]
        assert set(row["rewards"]) == {"length_reward", "accuracy"}
        assert row["reward"] == row["rewards"]["length_reward"]
        assert isinstance(row["advantage"], float)
        assert isinstance(row["prompt"], str) and isinstance(row["completion"], str)


def test_jsonl_rows_match_the_last_iteration(full_run):
    last = sorted(full_run.module.last_iteration.groups, key=lambda g: g.index)[0]
    rows = _jsonl(full_run)[-4:]
    assert [r["completion"] for r in rows] == last.completions
    assert [r["advantage"] for r in rows] == last.advantages


def test_tensorboard_gets_a_markdown_table(full_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(full_run.root / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    tag = "rollout_samples/text_summary"
    assert tag in events.Tags()["tensors"]
    texts = events.Tensors(tag)
    assert [t.step for t in texts] == list(range(STEPS))  # the metrics' steps
    table = texts[-1].tensor_proto.string_val[0].decode()
    assert (
        "| group | prompt | completion | reward | length_reward | accuracy | advantage |" in table
    )


def test_csv_logger_gets_a_csv_file(full_run):
    path = full_run.root / "csv" / "version_0" / "rollout_samples.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == STEPS * 4
    assert {"prompt", "completion", "rewards/length_reward", "advantage"} <= rows[0].keys()


def test_markdown_cells_are_escaped():
    group = RolloutGroup(
        index=0,
        prompt="a | b\nc",
        prompt_ids=[1],
        completion_ids=[[2], [3]],
        completions=["x|y", "z"],
        rewards=[1.0, 0.0],
        reward_components={"f": [1.0, 0.0]},
        advantages=[0.5, -0.5],
    )
    table = markdown_table(sample_rows([group], 0, 4))
    lines = table.splitlines()
    assert len(lines) == 4
    assert "a \\| b<br>c" in lines[2] and "x\\|y" in lines[2]
    assert lines[3].startswith("| 0 |  | z |")  # the prompt is shown once per group
