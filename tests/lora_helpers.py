"""Tiny peft LoRA policies with a non-zero adapter, shared by the adapter-push tests."""

from __future__ import annotations

import torch

QV = ["q_proj", "v_proj"]


def peft_policy(path: str, dtype: torch.dtype = torch.float32, **lora) -> torch.nn.Module:
    """A peft LoRA model on ``path`` whose B factors are random (peft starts them at zero, which
    would make every merge a no-op). ``lora`` overrides the ``LoraConfig`` arguments."""
    from peft import LoraConfig, get_peft_model

    from periodic_rl.models import load_causal_lm

    config = {"r": 4, "lora_alpha": 8, "target_modules": QV, "lora_dropout": 0.0, **lora}
    policy = get_peft_model(
        load_causal_lm(path, dtype=dtype), LoraConfig(task_type="CAUSAL_LM", **config)
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return policy


def sgd_step(policy: torch.nn.Module, token_ids: list[int], lr: float = 0.5) -> None:
    """One plain SGD step of the LoRA factors on a language-modelling loss (a training step)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    ids = torch.tensor([token_ids])
    policy.train()
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
