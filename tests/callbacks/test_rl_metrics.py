"""RLMetrics: added by every RLModule; the iteration's metrics land in the logger."""

from __future__ import annotations

import csv
import statistics

from callback_runs import STEPS

from periodic_rl.callbacks import RLMetrics

EXPECTED = (
    "reward",
    "reward_std",
    "reward_running",
    "rewards/length_reward",
    "completion_length",
    "clip_fraction",
    "entropy",
    "frac_zero_std_groups",
    "rollouts_per_s",
    "tokens_per_s",
    "mismatch/abs_logp",  # the HF engine reports behaviour log-probs
    "mismatch/kl",
)


def test_module_adds_rl_metrics_by_default(full_run):
    assert any(isinstance(c, RLMetrics) for c in full_run.trainer.callbacks)


def test_every_iteration_logs_the_rl_metrics(full_run):
    path = full_run.root / "csv" / "version_0" / "metrics.csv"
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward")]
    assert len(rows) == STEPS
    for name in EXPECTED:
        assert all(r[name] != "" for r in rows), name
    assert all(float(r["entropy"]) > 0 for r in rows)  # a random tiny model is far from greedy
    rewards = [float(r["reward"]) for r in rows]
    assert abs(float(rows[-1]["reward_running"]) - statistics.fmean(rewards)) < 1e-5
