"""Precision per side: trainer precision x rollout-engine dtype, speed and engine/trainer mismatch.

The demo's setup (``examples/arithmetic.yaml``, :func:`common.demo_settings`): SmolLM2-135M full
fine-tune (fp32 weights), vLLM in one Ray worker pinned to core 1, the trainer on core 0,
overlapped, 4 prompts x 8 samples of the arithmetic task. For each combination of the
Trainer's ``precision`` (``32-true``, ``bf16-mixed``) and the strategy's ``engine_dtype``
(``float32``, ``bfloat16``), one fit in a fresh child process; over its measured iterations
(after the warm-up ones):

- ``gen tok/s``: completion tokens / seconds some worker was generating (the run's spans);
- ``train s``: the trainer's training seconds per iteration (spans; waiting and pushes apart);
- ``iteration s``: the iteration's wall clock (``iteration_s`` of the module's stats);
- ``abs_logp``, ``kl``: the means of ``mismatch/abs_logp`` and ``mismatch/kl`` (engine
  behaviour log-probs against the trainer's; docs/guide.md).

Before the fits, one more child resolves ``engine_dtype="auto"`` for the demo's worker core
(measured afresh into a temporary cache, not the user's), and the result records what it chose
and the rates it measured.

Default run (about 12-15 minutes on the 2-core machine; a bf16 engine there is slow)::

    flock /tmp/cpu.lock .venv/bin/python benchmarks/precision.py

Quick smoke run::

    .venv/bin/python benchmarks/precision.py --iterations 1 --warmup 1 \\
        --trainer float32 --engine float32 --output /tmp/precision.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import (  # noqa: E402 - the benchmarks folder is not a package
    RESULTS_DIR,
    bare_trainer,
    demo_parts,
    demo_settings,
    load_average,
    machine_info,
    markdown_table,
    now_iso,
    write_json,
)

TRAINER_PRECISIONS = ("32-true", "bf16-mixed")
ENGINE_DTYPES = ("float32", "bfloat16")
#: The table's columns after the combination: (header, key of a summary row).
COLUMNS = (
    ("gen tok/s", "generation_tok_s"),
    ("train s", "training_s"),
    ("iteration s", "iteration_s"),
    ("abs_logp", "abs_logp"),
    ("kl", "kl"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=3, help="measured iterations per fit")
    p.add_argument("--warmup", type=int, default=1, help="iterations dropped at the start")
    p.add_argument("--trainer", nargs="+", default=list(TRAINER_PRECISIONS))
    p.add_argument("--engine", nargs="+", default=list(ENGINE_DTYPES), choices=ENGINE_DTYPES)
    p.add_argument("--no-auto", action="store_true", help="skip resolving engine_dtype=auto")
    p.add_argument("--max-new-tokens", type=int, default=24, help="the demo's 24")
    p.add_argument("--max-load", type=float, default=0.8, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for quiet")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds one child may take")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "precision.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one fit
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    machine = machine_info()
    settings = {**demo_settings(args.max_new_tokens), "warmup_iterations": args.warmup}
    print(f"machine: {machine['nproc']} x {machine['cpu_model']} {machine['cpu_flags']}")
    quiet = wait_for_quiet(args.max_load, args.max_wait)
    auto = None
    if not args.no_auto:
        auto = run_child(__file__, {"config": settings, "job": "auto"}, args.timeout)
        print(f"engine_dtype auto: {auto.get('choice') or auto.get('error')}")
    runs = []
    for precision in args.trainer:
        for dtype in args.engine:
            print(f"{precision} x {dtype}: load average {load_average()}")
            job = {
                "config": settings,
                "job": "fit",
                "precision": precision,
                "engine_dtype": dtype,
                "warmup": args.warmup,
                "steps": args.warmup + args.iterations,
            }
            result = run_child(__file__, job, args.timeout)
            if not result.get("ok", False):
                print(result.get("error") or result.get("log_tail"))
                raise SystemExit(f"the fit {precision} x {dtype} failed")
            runs.append(result)
    rows = [summarize(run) for run in runs]
    table = results_table(rows)
    print("\n" + table)
    data = {
        "benchmark": "precision",
        "date": now_iso(),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine,
        "git": machine["git"],
        "settings": settings,
        "load_before": quiet,
        "load_after": load_average(),
        "auto": {k: auto.get(k) for k in ("choice", "error", "process_s")} if auto else None,
        "rows": rows,
        "table_markdown": table,
        "runs": runs,
    }
    print(f"\nwrote {write_json(args.output, data)}")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One combination: generation tokens/s over the measured iterations (summed tokens over
    summed generating seconds), the medians of the seconds, the means of the mismatch."""
    its = [it for it in run["iterations"] if not it["warmup"]]
    generating = sum(it["generation_s"] for it in its)

    def mean(key: str) -> float | None:
        values = [it[key] for it in its if it.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {
        "precision": run["precision"],
        "engine_dtype": run["engine_dtype"],
        "n": len(its),
        "generation_tok_s": sum(it["tokens"] for it in its) / generating if generating else None,
        "training_s": statistics.median(it["training_s"] for it in its) if its else None,
        "iteration_s": statistics.median(it["iteration_s"] for it in its) if its else None,
        "abs_logp": mean("abs_logp"),
        "kl": mean("kl"),
    }


def results_table(rows: list[dict[str, Any]]) -> str:
    headers = ["trainer", "engine", "n", *(name for name, _ in COLUMNS)]
    body = []
    for row in rows:
        cells = []
        for _, key in COLUMNS:
            value = row[key]
            small = key in ("abs_logp", "kl")
            cells.append("-" if value is None else f"{value:.2e}" if small else round(value, 2))
        body.append([row["precision"], row["engine_dtype"], row["n"], *cells])
    return markdown_table(headers, body)


# ---- the children --------------------------------------------------------------------------------
def child_main(path: Path) -> None:
    job = json.loads(path.read_text())
    result = resolve_auto(job["config"]) if job["job"] == "auto" else run_fit(job)
    path.write_text(json.dumps({**job, **result}))


def resolve_auto(config: dict[str, Any]) -> dict[str, Any]:
    """What ``engine_dtype="auto"`` picks for the demo's worker cores, measured afresh."""
    from dataclasses import asdict

    from periodic_rl.cpu_tuning.engine_dtype import resolve_engine_dtype
    from periodic_rl.models import resolve_model

    with tempfile.TemporaryDirectory(prefix="prl-bench-dtype-") as tmp:
        model, cores = resolve_model(config["model"]), config["worker_cores"][0]
        choice = resolve_engine_dtype("vllm", model, cores, False, Path(tmp) / "cache.json")
    return {"ok": True, "choice": {**asdict(choice), "cores": cores}}


def run_fit(job: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    class Record(L.Callback):
        """Per iteration: tokens, generating and training seconds, wall clock, mismatch."""

        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stats = pl_module.last_iteration
            metrics = stats.metrics()
            spans = trainer.strategy.spans.summary()  # this iteration's
            self.records.append(
                {
                    "iteration": len(self.records),
                    "warmup": len(self.records) < job["warmup"],
                    "tokens": stats.num_tokens,
                    "generation_s": spans["generation_time"],
                    "training_s": spans["training_time"],
                    "iteration_s": metrics["iteration_s"],
                    "abs_logp": metrics.get("mismatch/abs_logp"),
                    "kl": metrics.get("mismatch/kl"),
                    "reward": metrics["reward"],
                }
            )

    config = job["config"]
    module, strategy, data = demo_parts(
        {**config, "engine_kwargs": dict(config["engine_kwargs"])},
        engine_dtype=job["engine_dtype"],
    )
    record = Record()
    trainer = bare_trainer(strategy, job["steps"], [record], precision=job["precision"])
    trainer.fit(module, datamodule=data)
    return {"ok": True, "iterations": record.records}


if __name__ == "__main__":
    main()
