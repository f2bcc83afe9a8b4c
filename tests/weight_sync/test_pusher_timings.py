"""`WeightPusher.timings`: the trainer side of a push, split into export and send."""

from __future__ import annotations

import time

import torch

from periodic_rl.weight_sync.fingerprint import weights_fingerprint
from periodic_rl.weight_sync.push import WeightPusher


class SlowPolicy:
    """A policy whose export and whose backend each take a known time."""

    model_path = "unused"

    def __init__(self) -> None:
        self.state = {"w": torch.arange(6.0).reshape(2, 3)}

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        time.sleep(0.05)
        return self.state

    def rollout_adapter(self) -> None:
        return None

    def rollout_base_state_dict(self) -> dict[str, torch.Tensor]:
        raise AssertionError("no adapter: never asked for the base")


class SlowBackend:
    def __init__(self) -> None:
        self.pushed: list[tuple[dict[str, torch.Tensor], int]] = []

    def push_weights(self, state_dict, version, keep=None) -> str:
        time.sleep(0.1)
        self.pushed.append((state_dict, version))
        return weights_fingerprint(state_dict)


def test_a_push_reports_its_export_and_send_seconds():
    pusher, policy, backend = WeightPusher(), SlowPolicy(), SlowBackend()
    assert pusher.timings == {}
    kind, fingerprint = pusher.push(backend, policy, version=3)  # type: ignore[arg-type]
    assert (kind, fingerprint) == ("full", weights_fingerprint(policy.state))
    assert backend.pushed == [(policy.state, 3)]
    assert set(pusher.timings) == {"export_s", "send_s"}
    assert 0.05 <= pusher.timings["export_s"] < 0.1 <= pusher.timings["send_s"]
