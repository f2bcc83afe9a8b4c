"""DeepSpeed ZeRO-2/3 (and the single-device strategy on CUDA) against the one-device update.

One GPU is one rank: ZeRO still partitions (over one rank), gathers parameters for the push
(stage 3) and divides the accumulated gradients through the ZeRO loss scale, which is what is
checked here. Run by benchmarks/gpu.sh (``pytest -m gpu``), which installs DeepSpeed.
"""

from __future__ import annotations

import pytest
import torch
from rl_helpers import max_diff, train

from periodic_rl.strategies import PeriodicAsyncDeepSpeedStrategy, PeriodicAsyncStrategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: DeepSpeed ZeRO and CUDA training"
    ),
]
IN_PROCESS = {"engine": "hf", "use_ray": False, "overlap": False}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_equals_one_device(tiny_llama_path, stage):
    pytest.importorskip("deepspeed", reason="pip install 'periodic_rl[deepspeed]'")
    reference = train(tiny_llama_path, steps=3, strategy=IN_PROCESS)
    zero = train(
        tiny_llama_path,
        steps=3,
        strategy={**IN_PROCESS, "stage": stage},
        strategy_cls=PeriodicAsyncDeepSpeedStrategy,
    )
    assert zero[2].push_counts["full"] == 4
    assert max_diff(zero[0], reference[0]) <= 1e-5


def test_single_device_trains_on_cuda(tiny_llama_path):
    params, module, strategy = train(
        tiny_llama_path, steps=2, strategy=IN_PROCESS, strategy_cls=PeriodicAsyncStrategy
    )
    assert strategy.root_device.type == "cuda" and strategy.policy_version == 2
