"""Shared-prompt packing vs the padded forward: training forward+backward time and memory.

For each model, group size G and (prompt, response) length pair, runs ``completion_logprobs``
(then ``backward()`` of a weighted sum of the log-probs, i.e. a training step without the
optimizer) on G completions of one prompt, packed and padded, and reports::

    token ratio = G (P + R) / (P + G R)     (tokens the padded path runs / tokens packed)
    time ratio  = padded time / packed time  (the measured wall-clock speed-up)
    cpu ratio   = the same with process CPU time (steadier when the machine is shared)
    efficiency  = time ratio / token ratio   (target >= 0.8)

Memory: the bytes of the tensors autograd saves for backward (parameters excluded). At the end of
the forward all of them are alive at once, which is where a training step peaks; parameters and
gradients are the same in both layouts. Deterministic, unlike RSS on a CPU, whose allocator keeps
freed memory (a sampled RSS high-water mark showed mostly the previous run's leftovers).

Quick check on a small config (what docs/shared_prompt.md shows)::

    .venv/bin/python benchmarks/shared_prompt.py --models small --quick

Everything (SmolLM2-135M as well, several minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/shared_prompt.py --models small smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from periodic_rl.attention import completion_logprobs

GROUP_SIZES = (4, 8, 16)
LENGTHS = ((256, 64), (128, 128), (64, 256))


def small_model() -> torch.nn.Module:
    """A 6-layer Llama (~15M params) whose body/lm_head FLOP ratio per token (~3:1) is SmolLM2's.

    The vocabulary projection costs the same in both layouts (only completion positions are
    projected), so a tiny body with a 49k vocabulary would measure the head, not the packing.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def smollm2_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from periodic_rl.models import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


MODELS = {"small": small_model, "smollm2": smollm2_model}


def train_step(model: torch.nn.Module, groups: list, shared: bool) -> dict[str, float]:
    """One forward+backward: wall and CPU seconds, and MiB of activations saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    model.zero_grad(set_to_none=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps, mask = completion_logprobs(model, groups, shared_prompt=shared)
    weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps)
    (logps * weights * mask).sum().backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    params = {p.data_ptr() for p in model.parameters()}
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "saved_mib": activations / 2**20,
    }


def make_groups(g: int, p: int, r: int, vocab: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (p,), generator=gen).tolist()
    return [(prompt, [torch.randint(3, vocab, (r,), generator=gen).tolist() for _ in range(g)])]


def measure(
    model: torch.nn.Module, g: int, p: int, r: int, repeats: int, warmup: int
) -> dict[str, Any]:
    vocab = model.config.vocab_size
    groups = make_groups(g, p, r, vocab, seed=g * 1000 + p)
    row: dict[str, Any] = {"G": g, "P": p, "R": r, "token_ratio": g * (p + r) / (p + g * r)}
    layouts = (("padded", False), ("packed", True))
    for _ in range(warmup):
        for _, shared in layouts:
            train_step(model, groups, shared)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in layouts}
    for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
        for name, shared in layouts:
            runs[name].append(train_step(model, groups, shared))
    for name, _ in layouts:
        # the minimum: the least disturbed run (timeit's convention)
        row[f"{name}_s"] = min(x["seconds"] for x in runs[name])
        row[f"{name}_cpu_s"] = min(x["cpu_seconds"] for x in runs[name])
        row[f"{name}_saved_mib"] = runs[name][0]["saved_mib"]
    row["time_ratio"] = row["padded_s"] / row["packed_s"]
    row["cpu_time_ratio"] = row["padded_cpu_s"] / row["packed_cpu_s"]
    row["cpu_efficiency"] = row["cpu_time_ratio"] / row["token_ratio"]
    row["efficiency"] = row["time_ratio"] / row["token_ratio"]
    row["memory_ratio"] = row["padded_saved_mib"] / max(row["packed_saved_mib"], 1e-9)
    return row


def print_table(model_name: str, rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'G':>3} {'P':>4} {'R':>4} | {'tok ratio':>9} {'time ratio':>10} {'eff':>5} "
        f"{'cpu ratio':>9} {'cpu eff':>7} | "
        f"{'padded s':>8} {'packed s':>8} | {'act. MiB pad/pack':>17} {'mem ratio':>9}"
    )
    print(f"\n## {model_name}\n{header}\n{'-' * len(header)}")
    for x in rows:
        print(
            f"{x['G']:>3} {x['P']:>4} {x['R']:>4} | {x['token_ratio']:>9.2f} "
            f"{x['time_ratio']:>10.2f} {x['efficiency']:>5.2f} {x['cpu_time_ratio']:>9.2f} "
            f"{x['cpu_efficiency']:>7.2f} | "
            f"{x['padded_s']:>8.2f} {x['packed_s']:>8.2f} | "
            f"{x['padded_saved_mib']:>8.0f}/{x['packed_saved_mib']:<8.0f} "
            f"{x['memory_ratio']:>9.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small"], choices=sorted(MODELS))
    parser.add_argument("--groups", nargs="+", type=int, default=list(GROUP_SIZES))
    parser.add_argument("--lengths", nargs="+", default=[f"{p}x{r}" for p, r in LENGTHS])
    parser.add_argument("--quick", action="store_true", help="1 warm-up, 2 timed runs per cell")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per cell and layout")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "shared_prompt.json"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, warmup = (2, min(args.warmup, 1)) if args.quick else (args.repeats, args.warmup)
    lengths = [tuple(int(v) for v in s.split("x")) for s in args.lengths]

    run = {
        "command": "python benchmarks/shared_prompt.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "backend": "auto (split on CPU)",
        "load_average_at_start": os.getloadavg()[0],
    }
    # one file for all models: a run replaces the entries of the models it measured
    results = json.loads(args.out.read_text()) if args.out.exists() else {"models": {}}
    for model_name in args.models:
        model = MODELS[model_name]().train()
        rows = []
        for p, r in lengths:
            for g in args.groups:
                rows.append(measure(model, g, p, r, repeats, warmup))
        print_table(model_name, rows)
        results["models"][model_name] = {**run, "rows": rows}
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
