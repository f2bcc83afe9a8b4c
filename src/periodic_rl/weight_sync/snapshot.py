"""`PolicySnapshot`: the weights of one policy version, frozen for a later push.

With bounded staleness the engines load version ``v`` while the trainer already trains on (and
steps) the live weights, so a push cannot read them later: right after the optimizer step the
trainer copies what the push will send. With LoRA and adapter pushes that is only the adapter
factors (a few MB); the frozen base is copied once and shared by every snapshot. Otherwise it is
the full merged weights (one copy of the model in CPU memory per version waiting to be pushed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from periodic_rl.weight_sync.push import PushablePolicy


def _copied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}


@dataclass(frozen=True)
class PolicySnapshot:
    """A :class:`~periodic_rl.weight_sync.push.PushablePolicy` whose weights are copies."""

    model_path: str
    state: dict[str, torch.Tensor] | None  # full merged weights (no adapter push)
    adapter: dict[str, torch.Tensor] | None
    base: dict[str, torch.Tensor] | None

    def to_checkpoint(self) -> dict[str, dict[str, torch.Tensor] | None]:
        """Plain tensors for a checkpoint (``weights_only`` loadable; the frozen base is not
        saved: it is the model's)."""
        return {"state": self.state, "adapter": self.adapter}

    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        if self.state is None:
            raise RuntimeError("this snapshot holds an adapter, not full weights")
        return self.state

    def rollout_adapter(self) -> dict[str, torch.Tensor] | None:
        return self.adapter

    def rollout_base_state_dict(self) -> dict[str, torch.Tensor]:
        if self.base is None:
            raise RuntimeError("this snapshot has no LoRA base")
        return self.base


class Snapshotter:
    """Takes :class:`PolicySnapshot` s of a policy, keeping one copy of its frozen LoRA base.

    Args:
        adapter_pushes: as :class:`~periodic_rl.weight_sync.push.WeightPusher`: with LoRA, copy
            only the adapter (the pusher will send only it).
    """

    def __init__(self, adapter_pushes: bool = True) -> None:
        self.adapter_pushes = adapter_pushes
        self._base: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def take(self, policy: PushablePolicy) -> PolicySnapshot:
        """Copy what a push of ``policy`` sends (call it where the weights are whole: inside the
        sharded strategies' gather)."""
        adapter = policy.rollout_adapter() if self.adapter_pushes else None
        if adapter is None:
            return PolicySnapshot(
                policy.model_path, _copied(policy.rollout_state_dict()), None, None
            )
        return PolicySnapshot(policy.model_path, None, _copied(adapter), self.base(policy))

    def base(self, policy: PushablePolicy) -> dict[str, torch.Tensor]:
        """The copy of ``policy``'s frozen LoRA base (taken once)."""
        if self._base is None:
            self._base = _copied(policy.rollout_base_state_dict())
        return self._base

    def from_checkpoint(
        self, policy: PushablePolicy, saved: dict[str, dict[str, torch.Tensor] | None]
    ) -> PolicySnapshot:
        """A snapshot saved by :meth:`PolicySnapshot.to_checkpoint`, its base from ``policy``."""
        adapter = saved.get("adapter")
        base = self.base(policy) if adapter is not None else None
        return PolicySnapshot(policy.model_path, saved.get("state"), adapter, base)
