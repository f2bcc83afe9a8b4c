"""A cheap, exact fingerprint of a set of weights, comparable across processes."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash


def weights_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash of every tensor's name, dtype, shape and bytes, in name order.

    Two processes that hold bit-identical weights get the same string; any changed bit changes it.
    XXH3-128 rather than a cryptographic hash: it is not guarding against an adversary, and it
    runs on the weight push's critical path, where a non-cryptographic hash is many times faster.
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
    (:mod:`periodic_rl.weight_sync.merge`): computed by the trainer from what it sends and by every
    worker from what it received, so a worker that merged another adapter, or into another
    base, reports a different string. The merge itself is deterministic code on both sides."""
    return combined_fingerprint("lora-adapter", base_fingerprint, weights_fingerprint(adapter))


def loaded_fingerprint(
    received: Mapping[str, torch.Tensor], held: Mapping[str, torch.Tensor]
) -> str:
    """The fingerprint an engine reports after a load: :func:`weights_fingerprint` of ``held``,
    the tensors it holds *after* loading (read back from the engine, under the received names),
    so it equals the sender's ``weights_fingerprint(received)`` only if every received tensor
    landed bit for bit. A received name missing from ``held`` changes it (a dropped tensor).

    A tensor held in another dtype than it arrived in (an fp32 engine given bf16 weights) counts
    as landed when it is exactly the received tensor converted to that dtype; the received bytes
    are hashed for it then, as the sender did. Anything else is hashed as held, and so differs.
    """
    parts: dict[str, torch.Tensor] = {}
    for name, tensor in held.items():
        sent = received.get(name)
        if (
            sent is not None
            and tensor.dtype != sent.dtype
            and tensor.shape == sent.shape
            and torch.equal(tensor.detach().cpu(), sent.detach().cpu().to(tensor.dtype))
        ):
            parts[name] = sent
        else:
            parts[name] = tensor
    return weights_fingerprint(parts)
