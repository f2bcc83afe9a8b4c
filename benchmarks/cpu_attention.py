"""Packed attention on the CPU in bf16: torch's kernel in bf16 against the same in float32.

The ``split`` backend (the CPU default) computes half-precision inputs in float32 and casts the
output back (``periodic_rl.attention.backends.cpu_float32``), because torch's CPU attention
kernels are slower in bf16. This measures that claim twice, interleaved, on the machine at hand:

- **kernel**: one layer's ``split`` attention, forward and backward, on SmolLM2-135M's head
  shapes (9 query heads, 3 key/value heads, 64 dims) for 2 groups of 8 completions (47-token
  prompt, 11-token completions): float32 inputs; bf16 inputs computed in bf16 (the backend
  without the wrapper); bf16 inputs through the backend (computed in float32).
- **micro-batch**: SmolLM2-135M-Instruct's packed training forward and backward on the same 2
  groups, in float32, under bf16 autocast with the attention in bf16, and under bf16 autocast as
  the library runs it.

Run (2 cores, under a minute)::

    flock /tmp/cpu.lock .venv/bin/python benchmarks/cpu_attention.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from common import machine_info, markdown_table, now_iso, write_json

from periodic_rl.attention import (
    BACKENDS,
    AttentionBackend,
    AttentionOptions,
    SharedPromptLayout,
    completion_logprobs,
    register_backend,
)

PROMPT, COMPLETION, GROUPS, G = 47, 11, 2, 8
HEADS, KV_HEADS, DIM = 9, 3, 64


def seconds(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        out.append(time.perf_counter() - began)
    return out


def kernel_cases() -> dict[str, Callable[[], None]]:
    layout = SharedPromptLayout([PROMPT] * GROUPS, [[COMPLETION] * G] * GROUPS, backend="split")
    n = layout.total_len
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, h, n, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    wrapped = BACKENDS["split"].fn
    bare = wrapped.__wrapped__  # the kernel without the float32 wrapper
    opt = AttentionOptions()

    def case(fn, dtype: torch.dtype) -> Callable[[], None]:
        q, k, v = (x.to(dtype).requires_grad_() for x in base)

        def run() -> None:
            fn(q, k, v, layout, opt).float().sum().backward()

        return run

    return {
        "float32": case(wrapped, torch.float32),
        "bf16, computed in bf16": case(bare, torch.bfloat16),
        "bf16, computed in float32 (the library)": case(wrapped, torch.bfloat16),
    }


def micro_batch_cases() -> dict[str, Callable[[], None]]:
    from transformers import AutoModelForCausalLM

    from periodic_rl.models import SMOLLM2_ALIAS, resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(SMOLLM2_ALIAS), dtype=torch.float32)
    model.train()
    register_backend(
        AttentionBackend(
            "split-bf16", BACKENDS["split"].fn.__wrapped__, BACKENDS["split"].unavailable
        )
    )
    rng = random.Random(0)
    groups = [
        (
            [rng.randrange(100, 40000) for _ in range(PROMPT)],
            [[rng.randrange(100, 40000) for _ in range(COMPLETION)] for _ in range(G)],
        )
        for _ in range(GROUPS)
    ]

    def case(backend: str, autocast: bool) -> Callable[[], None]:
        def run() -> None:
            context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
            with context:
                logps, mask = completion_logprobs(model, groups, backend=backend)
            (logps * mask).sum().backward()
            model.zero_grad(set_to_none=True)

        return run

    return {
        "float32": case("split", False),
        "bf16 autocast, attention in bf16": case("split-bf16", True),
        "bf16 autocast, attention in float32 (the library)": case("split", True),
    }


def measure(cases: dict[str, Callable[[], None]], rounds: int, repeats: int) -> dict[str, list]:
    """Interleaved: each round runs every case ``repeats`` times, in turn."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name] += seconds(fn, repeats)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/cpu_attention.json")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.time()
    parts = {
        "kernel (one layer, ms)": (measure(kernel_cases(), rounds=3, repeats=20), 1e3),
        "micro-batch (SmolLM2-135M, s)": (measure(micro_batch_cases(), rounds=3, repeats=3), 1.0),
    }
    rows, summary = [], {}
    for part, (times, unit) in parts.items():
        reference = statistics.median(next(iter(times.values())))
        for name, values in times.items():
            median = statistics.median(values)
            summary.setdefault(part, {})[name] = {"median": median * unit, "n": len(values)}
            rows.append(
                [part, name, len(values), round(median * unit, 3), f"{median / reference:.2f}x"]
            )
    table = markdown_table(["what", "case", "n", "median", "vs float32"], rows)
    print(table)
    write_json(
        args.output,
        {
            "benchmark": "cpu_attention",
            "date": now_iso(),
            "command": "python benchmarks/cpu_attention.py",
            "machine": machine_info(),
            "torch_threads": torch.get_num_threads(),
            "shapes": {
                "groups": GROUPS,
                "completions_per_group": G,
                "prompt_tokens": PROMPT,
                "completion_tokens": COMPLETION,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": DIM,
            },
            "wall_s": time.time() - began,
            "summary": summary,
            "table_markdown": table,
        },
    )


if __name__ == "__main__":
    main()
