"""The weights payload: state dicts as numpy views for one ``ray.put``, and back."""

from __future__ import annotations

import pickle

import torch

from periodic_rl.weight_sync.fingerprint import weights_fingerprint
from periodic_rl.weight_sync.transport import from_payload, to_payload


def test_payload_round_trip_without_copies():
    state = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randn(4, 3).t(),  # non-contiguous: made contiguous once
        "d": torch.arange(6, dtype=torch.int64),
    }
    state["tied"] = state["a"]  # tied weights travel once
    payload = to_payload(state)
    assert payload["dtypes"] == {"b": "bfloat16"}
    assert payload["aliases"] == {"tied": "a"} and "tied" not in payload["arrays"]
    assert payload["arrays"]["a"].ctypes.data == state["a"].data_ptr()  # a view, not a copy
    back = from_payload(payload)
    assert {k: v.dtype for k, v in back.items()} == {k: v.dtype for k, v in state.items()}
    assert back["a"].data_ptr() == state["a"].data_ptr() == back["tied"].data_ptr()
    assert list(back) == [*[k for k in state if k != "tied"], "tied"]
    assert weights_fingerprint(back) == weights_fingerprint(state)
    # What travels through Ray is a pickle (protocol 5 keeps the buffers out of band).
    again = from_payload(pickle.loads(pickle.dumps(payload, protocol=5)))
    assert weights_fingerprint(again) == weights_fingerprint(state)
