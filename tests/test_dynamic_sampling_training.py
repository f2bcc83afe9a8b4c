"""Dynamic sampling through RLModule: groups whose rewards are all equal never reach the loss,
every iteration still trains on ``batch_size`` groups, and the metrics count what was dropped
and what was added; with bounded staleness too."""

from __future__ import annotations

import pytest
from rl_helpers import RecordingModule, train

from periodic_rl import RLModule


def half_flat_reward(prompts, completions, **columns):
    """Constant for prompts of even length (a zero-variance group), spread for the others."""
    if len(prompts[0]) % 2 == 0:
        return [0.5] * len(completions)
    return [len(c) / 10.0 for c in completions]


class MetricsRecording(RecordingModule):
    """Keeps every iteration's metrics and groups."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.iterations = []

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        stats = self.last_iteration
        self.iterations.append((stats.metrics(), list(stats.groups)))


@pytest.mark.parametrize("staleness", [0, 1], ids=["on-policy", "k1"])
def test_no_zero_variance_group_is_trained_and_the_count_is_kept(tiny_llama_path, staleness):
    strategy = {"engine": "hf", "use_ray": False, "overlap": False, "max_staleness": staleness}
    _, module, _ = train(
        tiny_llama_path,
        steps=3,
        batch_size=4,
        strategy=strategy,
        module_cls=MetricsRecording,
        reward_funcs=[half_flat_reward],
        dynamic_sampling=True,
    )
    dropped = 0
    for metrics, groups in module.iterations:
        assert len(groups) == 4  # the iteration stayed full
        assert all(max(g.rewards) > min(g.rewards) for g in groups)  # never zero variance
        assert metrics["frac_zero_std_groups"] == 0.0
        used, flat = (metrics[f"dynamic_sampling/{k}"] for k in ("spares_used", "zero_std_dropped"))
        assert used <= flat  # a spare replaces a dropped original; spares can be flat too
        dropped += metrics["dynamic_sampling/zero_std_dropped"]
    assert dropped > 0, "no group was ever dropped: a weak test"
    assert sum(m["dynamic_sampling/spares_used"] for m, _ in module.iterations) > 0


def test_bad_dynamic_sampling_bounds_name_the_field(tiny_llama_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_batches must be >= 1"):
        RLModule(model=tiny_llama_path, dynamic_sampling=True, dynamic_sampling_max_batches=0)
    with pytest.raises(ValueError, match="dynamic_sampling_spares_ahead must be >= 0"):
        RLModule(model=tiny_llama_path, dynamic_sampling_spares_ahead=-1)
