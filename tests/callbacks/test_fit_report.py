"""FitReport: report.md with the start and end held-out reward, and the reward curve PNG."""

from __future__ import annotations

import pytest
from callback_runs import STEPS
from matplotlib.image import imread

from periodic_rl.callbacks.report import held_out_table, pipeline_shares


def test_report_sees_the_final_evaluation(full_run):
    evals = full_run.module.eval_history
    assert [e["tag"] for e in evals] == ["start", "end"]
    report = full_run.callbacks["FitReport"]
    assert report.report_path == full_run.root / "tb" / "version_0" / "report.md"
    text = report.report_path.read_text()
    start, end = evals
    assert f"| reward | {start['reward']:.4g} | {end['reward']:.4g} |" in text
    assert "| accuracy |" in text and "| correctness_reward |" not in text  # length reward run
    assert f"- iterations: {STEPS}" in text
    assert "rollouts/s" in text and "overlap ratio" in text
    assert "shares of all iterations' time: worker idle" in text


def test_report_names_checkpoint_and_exported_model(full_run):
    text = full_run.callbacks["FitReport"].report_path.read_text()
    checkpoint = full_run.trainer.checkpoint_callback.best_model_path
    assert checkpoint and f"`{checkpoint}`" in text
    assert f"`{full_run.callbacks['HFExport'].final_path}`" in text


def test_reward_curve_png(full_run):
    report = full_run.callbacks["FitReport"]
    assert [h["iteration"] for h in report.history] == list(range(STEPS))
    assert len(report.pipeline) == STEPS
    image = imread(report.curve_path)
    assert image.shape[0] >= 300 and image.shape[1] >= 500


def test_pipeline_shares_weight_each_iteration_by_its_wall_time():
    def summary(wall, busy, training, push, lent, workers=2.0):
        return {
            "wall_time": wall,
            "worker_busy_time": busy,
            "training_time": training,
            "push_time": push,
            "cores_lent_time": lent,
            "num_workers": workers,
        }

    shares = pipeline_shares(
        [summary(10.0, 15.0, 6.0, 1.0, 2.0), summary(30.0, 45.0, 24.0, 2.0, 4.0)]
    )
    assert shares["worker_idle"] == pytest.approx(1 - 60 / 80)
    assert shares["cores_lent"] == pytest.approx(6 / 40)
    assert shares["trainer_idle"] == pytest.approx(1 - 30 / 40)
    assert shares["push"] == pytest.approx(3 / 40)
    empty = {"worker_idle": 0.0, "cores_lent": 0.0, "trainer_idle": 0.0, "push": 0.0}
    assert pipeline_shares([]) == empty


def test_a_reward_name_markdown_would_eat_is_shown_as_code():
    rows = held_out_table({"reward": 1.0, "<lambda>": 0.5}, {"reward": 2.0, "<lambda>": 0.75})
    assert "| `<lambda>` | 0.5 | 0.75 | +0.25 |" in rows
    assert "| reward | 1 | 2 | +1 |" in rows  # plain names stay plain
