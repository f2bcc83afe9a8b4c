"""A cheap, exact fingerprint of a set of weights, comparable across processes."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash


def weights_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash of every tensor's name, dtype, shape and bytes, in name order.

    Two processes that hold bit-identical weights get the same string; any changed bit changes it.
    XXH3-128 rather than a cryptographic hash: it is not guarding against an adversary, it runs
    on the weight push's critical path, and it hashes 540 MB in ~0.04 s where blake2b takes ~0.5 s.
    """
    digest = xxhash.xxh3_128()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def combined_fingerprint(*parts: str) -> str:
    """One fingerprint standing for several (e.g. a base and the adapter merged into it)."""
    return xxhash.xxh3_128("|".join(parts).encode()).hexdigest()


def adapter_fingerprint(base_fingerprint: str, adapter: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of base weights with a LoRA adapter payload merged in
    (:mod:`periodic_rl.lora_push`): computed by the trainer from what it sends and by every
    worker from what it received, so a worker that merged another adapter, or into another
    base, reports a different string. The merge itself is deterministic code on both sides."""
    return combined_fingerprint("lora-adapter", base_fingerprint, weights_fingerprint(adapter))
