"""A pushed vLLM engine samples like a fresh engine started from the same weights
(``tests/repro_vllm_reload.py``: a fit changes a tied-embedding model, then both engines
generate the same seeded requests; tokens and behaviour log-probs must agree)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rl_helpers import starting_threads

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def reload(vllm_slot, tmp_path_factory):
    """The fit and the fresh engine's samples, once for both push paths."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from repro_vllm_reload import prepare

    vllm_slot.release()  # one in-process engine at a time
    torch.set_num_threads(starting_threads())  # as vLLM's CPU attention expects
    return prepare(tmp_path_factory.mktemp("reload"))


@pytest.mark.parametrize("fast_reload", ["1", "0"], ids=["fast reload", "vllm reload"])
def test_a_pushed_engine_samples_like_a_fresh_one(reload, monkeypatch, fast_reload):
    """Both push paths: the fast reload (the default) and vLLM's own in-place reload followed
    by the tied heads' refresh (``PERIODIC_RL_VLLM_FAST_RELOAD=0``, and where the fast reload
    does not apply)."""
    from repro_vllm_reload import pushed_samples_agree

    monkeypatch.setenv("PERIODIC_RL_VLLM_FAST_RELOAD", fast_reload)
    torch.set_num_threads(starting_threads())
    assert pushed_samples_agree(reload) == 0
