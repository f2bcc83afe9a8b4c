"""What a checkpoint costs the pipeline: seconds of an iteration that saves vs a normal one,
written synchronously (``AtomicCheckpointIO``) vs in the background (``AsyncAtomicCheckpointIO``,
the strategies' default).

The demo's setup (``examples/arithmetic.yaml``): SmolLM2-135M-Instruct full fine-tune in fp32
with AdamW (a checkpoint of about 1.5 GB: weights and both moments), vLLM in one Ray rollout
worker, overlapped, trainer pinned to core 0 and the worker to core 1, the built-in arithmetic
task. **One** ``fit`` runs both modes: a callback switches ``strategy.checkpoint_io`` before
each save, so both share the processes, the warm caches and whatever else the machine does,
in an ABBA order of saves. A save is what ``ModelCheckpoint(save_last=True)`` does at the end of
an iteration: the step's file, the removal of the previous one, then ``last.ckpt``.

The schedule: warm-up iterations (dropped), then blocks of three iterations: the one that
saves at its end (``save``), the next one (``after``: an asynchronous write is still going on
then) and a ``normal`` one (nothing being written). Per iteration: wall clock from one
iteration's start to the next one's (the save included); ``save_s`` is the time the save calls
themselves kept the training loop. Before each synchronous save, the earlier background write
is waited for (``waited_s``, reported) so that two writers never overlap.

Default run (about 8-10 minutes on the 2-core machine)::

    .venv/bin/python benchmarks/checkpoint_stall.py

Quick smoke run (about 4 minutes)::

    .venv/bin/python benchmarks/checkpoint_stall.py --saves-per-mode 1 --output /tmp/stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
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

MODES = ("async", "sync")
TARGET = 1.10  # a checkpoint iteration within 10% of a normal one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves-per-mode", type=int, default=3, help="measured saves per mode")
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped at the start")
    p.add_argument("--max-new-tokens", type=int, default=24, help="the demo's 24")
    p.add_argument("--max-load", type=float, default=0.8, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for quiet")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds the fit may take")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "checkpoint_stall.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: the fit
    return p.parse_args(argv)


def schedule(saves_per_mode: int, warmup: int) -> list[dict[str, Any]]:
    """Warm-up iterations, then per save a block (save, after, normal); modes in ABBA order."""
    abba = [MODES[0], MODES[1], MODES[1], MODES[0]]
    order = [abba[i % 4] for i in range(2 * saves_per_mode)]
    plan = [{"kind": "warmup", "mode": None} for _ in range(warmup)]
    for mode in order:
        plan += [
            {"kind": "save", "mode": mode},
            {"kind": "after", "mode": mode},
            {"kind": "normal", "mode": None},
        ]
    return plan


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    machine = machine_info()
    plan = schedule(args.saves_per_mode, args.warmup)
    settings = {
        **demo_settings(args.max_new_tokens),
        "saves_per_mode": args.saves_per_mode,
        "warmup_iterations": args.warmup,
    }
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}, git {machine['git']}")
    quiet = wait_for_quiet(args.max_load, args.max_wait)
    print(f"load average {quiet['load_average']}; {len(plan)} iterations: {plan}")
    result = run_child(__file__, {"config": settings, "schedule": plan}, args.timeout)
    if not result.get("ok", True) or "iterations" not in result:
        print(result.get("error") or result.get("log_tail"))
        raise SystemExit("the fit failed")
    iterations = result["iterations"]
    summary = summarize(iterations)
    table = results_table(summary)
    print_iterations(iterations)
    print("\n" + table)
    verdict = summary["verdict"]
    print(verdict)
    data = {
        "benchmark": "checkpoint_stall",
        "date": now_iso(),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine,
        "settings": settings,
        "load_before": quiet,
        "load_after": load_average(),
        "summary": summary,
        "table_markdown": table,
        "run": result,
    }
    print(f"\nwrote {write_json(args.output, data)}")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(iterations: list[dict[str, Any]]) -> dict[str, Any]:
    normal = [it["seconds"] for it in iterations if it["kind"] == "normal"]
    base = median(normal)
    rows = {"normal": {"n": len(normal), "seconds": base, "ratio": 1.0}}
    for mode in MODES:
        for kind in ("save", "after"):
            its = [it for it in iterations if it["kind"] == kind and it["mode"] == mode]
            seconds = median([it["seconds"] for it in its])
            rows[f"{mode} {kind}"] = {
                "n": len(its),
                "seconds": seconds,
                "ratio": seconds / base if seconds and base else None,
                "save_s": median([it["save_s"] for it in its]) if kind == "save" else None,
                "max_save_s": max((it["save_s"] for it in its), default=None)
                if kind == "save"
                else None,
                "waited_s": median([it.get("waited_s", 0.0) for it in its]),
            }
    ratio = rows["async save"]["ratio"]
    after = rows["async after"]["ratio"]
    sync = rows["sync save"]["ratio"]
    verdict = (
        f"async: a saving iteration takes {ratio:.2f}x a normal one (target <= {TARGET:.2f}: "
        f"{'met' if ratio <= TARGET else 'NOT met'}), the one after it {after:.2f}x; "
        f"sync: {sync:.2f}x"
        if ratio and after and sync
        else "incomplete"
    )
    return {"rows": rows, "target_ratio": TARGET, "verdict": verdict}


def results_table(summary: dict[str, Any]) -> str:
    def num(value: Any, digits: int = 2) -> Any:
        return "-" if value is None else round(float(value), digits)

    rows = [
        [name, row["n"], num(row["seconds"]), f"{num(row['ratio'])}x", num(row.get("save_s"))]
        for name, row in summary["rows"].items()
    ]
    return markdown_table(["iterations", "n", "median s", "vs normal", "save call s"], rows)


def print_iterations(iterations: list[dict[str, Any]]) -> None:
    print("\niteration  kind    mode   seconds  save_s  waited_s")
    for it in iterations:
        print(
            f"{it['iteration']:9d}  {it['kind']:6s}  {it['mode'] or '-':5s}  "
            f"{it['seconds']:7.2f}  {it.get('save_s', 0.0):6.2f}  {it.get('waited_s', 0.0):8.2f}"
        )


# ---- the child: one fit ------------------------------------------------------------------------
def child_main(path: Path) -> None:
    job = json.loads(path.read_text())
    result = run_fit(job["config"], job["schedule"])
    path.write_text(json.dumps({**job, **result}))


def run_fit(config: dict[str, Any], plan: list[dict[str, Any]]) -> dict[str, Any]:
    import lightning as L
    import torch

    from periodic_rl.checkpoint import AsyncAtomicCheckpointIO, AtomicCheckpointIO

    ios = {"async": AsyncAtomicCheckpointIO(), "sync": AtomicCheckpointIO()}

    class SavePlan(L.Callback):
        """Times each iteration; at the end of a ``save`` iteration does what
        ``ModelCheckpoint(save_last=True)`` does, through the mode's checkpoint IO."""

        def __init__(self, directory: Path) -> None:
            self.directory = directory
            self.records: list[dict[str, Any]] = []
            self.previous: Path | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.records:
                self.records[-1]["seconds"] = now - self.records[-1]["start"]
            step = plan[len(self.records)]
            record = {"iteration": len(self.records), **step, "start": now}
            if step["kind"] == "save" and step["mode"] == "sync":
                began = time.perf_counter()  # never two writers at once
                ios["async"].wait()
                record["waited_s"] = time.perf_counter() - began
                record["start"] = time.perf_counter()
            if step["kind"] == "save" and step["mode"] == "async":
                # Is the previous background write still running when this iteration starts?
                record["write_pending"] = bool(ios["async"]._pending)
                record["buffers_ready"] = sum(len(b) for b in ios["async"]._buffers.values())
            self.records.append(record)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            record = self.records[-1]
            if record["kind"] != "save":
                return
            trainer.strategy.checkpoint_io = ios[record["mode"]]
            record["pending_at_save"] = bool(ios["async"]._pending)  # a write not yet done
            began = time.perf_counter()
            path = self.directory / f"step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            if self.previous is not None:
                trainer.strategy.remove_checkpoint(self.previous)
            trainer.save_checkpoint(self.directory / "last.ckpt")
            record["save_s"] = time.perf_counter() - began
            self.previous = path

        def on_train_end(self, trainer, pl_module) -> None:
            if self.records and "seconds" not in self.records[-1]:
                self.records[-1]["seconds"] = time.perf_counter() - self.records[-1]["start"]

    with tempfile.TemporaryDirectory(prefix="prl-ckpt-stall-") as tmp:
        module, strategy, data = demo_parts(config, checkpoint_io=ios["sync"])
        saves = SavePlan(Path(tmp))
        trainer = bare_trainer(strategy, len(plan), [saves])
        began = time.time()
        trainer.fit(module, datamodule=data)
        fit_s = time.time() - began
        strategy.checkpoint_io = ios["async"]
        ios["async"].teardown()
        size = (Path(tmp) / "last.ckpt").stat().st_size
        last = torch.load(Path(tmp) / "last.ckpt", weights_only=True, mmap=True)
    return {
        "ok": True,
        "fit_s": fit_s,
        "checkpoint_mib": round(size / 2**20, 1),
        "last_global_step": last["global_step"],
        "loadavg_end": list(os.getloadavg()),
        "iterations": saves.records,
    }


if __name__ == "__main__":
    main()
