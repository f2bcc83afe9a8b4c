"""PipelineMetrics: the strategy's timing summary logged per iteration under pipeline/."""

from __future__ import annotations

import csv

from callback_runs import STEPS

from periodic_rl.callbacks.metrics import KEYS


def test_history_has_every_iteration_with_its_push(full_run):
    history = full_run.callbacks["PipelineMetrics"].history
    assert [h["iteration"] for h in history] == list(range(STEPS))
    for h in history:
        assert h["generation_time"] > 0 and h["training_time"] > 0
        assert h["push_time"] > 0  # the iteration's own weight push is already recorded
        assert 0.0 <= h["overlap_ratio"] <= 1.0


def test_csv_logger_has_a_pipeline_column_per_key(full_run):
    path = full_run.root / "csv" / "version_0" / "metrics.csv"
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/generation_time")]
    assert len(rows) == STEPS
    for key in KEYS:
        assert all(float(r[f"pipeline/{key}"]) >= 0 for r in rows)
    assert all(r["reward"] for r in rows)  # same row as the module's own metrics
