"""FitReport: report.md with the start and end held-out reward, and the reward curve PNG."""

from __future__ import annotations

from callback_runs import STEPS
from matplotlib.image import imread


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
