"""The fingerprint both sides of a push compare: an engine's report of what it holds after a
load equals the sender's only when every tensor landed bit for bit.

That the engines report it of what they hold, not of what they were sent, is tested with the
engines (tests/rollout/test_engine_fingerprints.py).
"""

from __future__ import annotations

import torch

from periodic_rl.weight_sync.fingerprint import loaded_fingerprint, weights_fingerprint


def test_loaded_fingerprint_is_the_senders_only_when_everything_landed():
    sent = {"a": torch.linspace(-1, 1, 6).reshape(2, 3), "b": torch.ones(4)}
    assert loaded_fingerprint(sent, {k: v.clone() for k, v in sent.items()}) == (
        weights_fingerprint(sent)
    )
    assert loaded_fingerprint(sent, {"a": sent["a"]}) != weights_fingerprint(sent)  # b lost
    changed = {"a": sent["a"], "b": sent["b"].clone()}
    changed["b"][0] = 2.0
    assert loaded_fingerprint(sent, changed) != weights_fingerprint(sent)
    # Held in another dtype: exactly the received tensor, converted, counts as landed.
    bf16 = {k: v.to(torch.bfloat16) for k, v in sent.items()}
    widened = {k: v.float() for k, v in bf16.items()}
    assert loaded_fingerprint(bf16, widened) == weights_fingerprint(bf16)
    widened["a"][0, 0] += 2**-20  # no longer the conversion of what was sent
    assert loaded_fingerprint(bf16, widened) != weights_fingerprint(bf16)
