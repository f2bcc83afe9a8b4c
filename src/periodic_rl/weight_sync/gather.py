"""Full weights on rank 0 from a sharded model, for one push.

Under FSDP2 (``fully_shard``) each parameter is a ``DTensor`` holding this rank's shard; under
DeepSpeed ZeRO-3 each parameter's ``data`` is empty outside ``GatheredParameters``. The push
needs every weight whole on the rank that talks to the engines. :func:`gathered_on_rank0`
gathers the parameters one at a time, in the same order on every rank (each gather is a
collective), moves each whole tensor to rank 0's CPU at once (the accelerator never holds more
than one gathered tensor), and swaps the whole copies into the model on rank 0 for the duration
of the ``with`` block, so the usual export (:mod:`periodic_rl.weight_sync.export`, LoRA merge
included) reads them as if the model had never been sharded. On exit the sharded parameters
are put back untouched. Other ranks take part in the gathers and hold nothing extra.

Unsharded models (one device, DDP) need none of this: :func:`gathered_on_rank0` with
``gather=None`` is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# (module, parameter name, parameter) -> the whole tensor (on every rank), or None when
# the parameter is not sharded.
GatherFn = Callable[[torch.nn.Module, str, torch.nn.Parameter], torch.Tensor | None]


def fsdp2_full_tensor(
    module: torch.nn.Module, name: str, param: torch.nn.Parameter
) -> torch.Tensor | None:
    """The whole tensor of an FSDP2 (``DTensor``) parameter: ``full_tensor()``, a collective."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else None


def zero3_full_tensor(
    module: torch.nn.Module, name: str, param: torch.nn.Parameter
) -> torch.Tensor | None:
    """The whole tensor of a DeepSpeed ZeRO-3 parameter, through ``GatheredParameters`` (a
    collective); ``None`` for a parameter ZeRO-3 does not partition."""
    if not hasattr(param, "ds_id"):
        return None
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.data.detach().to("cpu", copy=True)


@contextmanager
def gathered_on_rank0(
    model: torch.nn.Module, gather: GatherFn | None, rank: int
) -> Iterator[torch.nn.Module]:
    """Within the block, ``model`` holds whole parameters on rank 0 (see module docstring).

    Args:
        model: the sharded model (e.g. the policy, peft wrapper included).
        gather: how to make one parameter whole (:func:`fsdp2_full_tensor`,
            :func:`zero3_full_tensor`), or ``None`` when nothing is sharded.
        rank: this process's rank; only rank 0 keeps the whole tensors.
    """
    if gather is None:
        yield model
        return
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    copies: dict[int, torch.nn.Parameter | None] = {}  # id(sharded param) -> its whole copy
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in copies:  # a tied weight sits in two modules: gather it once
                full = gather(module, name, param)
                keep = full is not None and rank == 0
                copies[id(param)] = (
                    torch.nn.Parameter(full.detach().to("cpu"), requires_grad=param.requires_grad)
                    if keep
                    else None
                )
            if copies[id(param)] is not None:
                swapped.append((module, name, param))
    try:
        for module, name, param in swapped:
            setattr(module, name, copies[id(param)])
        yield model
    finally:
        for module, name, param in swapped:
            setattr(module, name, param)
