"""FSDP2 sharding of the policy, for ``periodic_async_fsdp`` (Lightning's ModelParallelStrategy).

Each decoder layer becomes one FSDP unit (its parameters are gathered together for its forward
and backward, then freed), and the whole policy one more for what is left (embeddings, final
norm, head). The layers are the modules transformers itself never splits across devices
(``_no_split_modules`` of the model class, through :mod:`periodic_rl.compat.transformers`).
"""

from __future__ import annotations

from typing import Any

import torch


def shard_policy(policy: torch.nn.Module, mesh: Any) -> int:
    """``fully_shard`` every decoder layer of ``policy`` and then ``policy`` itself over the
    1-D device ``mesh`` (the data-parallel ranks); returns the number of layer units.

    Raises ``ValueError`` when no decoder layer is found (the model would be one FSDP unit:
    correct, but every rank would gather the whole model at once).
    """
    from torch.distributed.fsdp import fully_shard

    from periodic_rl.compat.transformers import decoder_layer_classes

    classes = decoder_layer_classes(policy)
    layers = [m for m in policy.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(
            f"periodic_async_fsdp found no decoder layer to shard in {type(policy).__name__} "
            f"(layer classes {sorted(classes)}); use periodic_async_ddp for this model"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return len(layers)
