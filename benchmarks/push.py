"""Where the weight push's time goes, and its share of an iteration, in the demo's setup.

The demo's setup (``examples/arithmetic.yaml``): SmolLM2-135M-Instruct full fine-tune in fp32
(538 MB of weights per push), vLLM in one Ray rollout worker pinned to core 1, the trainer on
core 0, overlapped, the built-in arithmetic task, 4 prompts x 8 samples per iteration. One
``fit``; a callback reads, after each iteration's optimizer step and push, every phase from the
end of the step to the worker's confirmed fingerprint:

- ``step_to_push``: end of the optimizer step to the start of the push (the trainer's "weight
  push" span);
- ``export``: the policy's weights as a state dict (``WeightPusher.timings``);
- ``put``: into the object store (``RayRollouts.timings["last_push_put_s"]``); the trainer's
  fingerprint runs in a thread meanwhile (``hash_done``: when it was done, from the push start);
- ``load``: from the put to every worker's fingerprint checked, of which the worker's own
  ``fetch`` (the payload from the object store), vLLM's ``reload`` (copy in, fuse, repack),
  ``verify`` (the worker's fingerprint of what landed) and ``reset`` (prefix cache);
  ``load - worker`` is Ray's call overhead and waiting;
- ``push``: the whole trainer span; ``iteration``: wall clock from one iteration's start to the
  next one's; ``share``: push / iteration.

With ``--modes`` naming more than one push path, each runs its own fit, one after the other,
in the order given (a mode may set environment variables that only a new Ray worker process
reads, such as glibc's ``MALLOC_*`` tunables).

Default run (about 3 minutes on the 2-core machine)::

    .venv/bin/python benchmarks/push.py

Quick smoke run (about 90 seconds)::

    .venv/bin/python benchmarks/push.py --iterations 2 --warmup 1 --output /tmp/push.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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

#: Push paths a run can compare: environment variables the fit's processes (Ray, its workers)
#: start with.
MODES: dict[str, dict[str, str]] = {
    "default": {},
    # glibc keeps freed memory instead of returning it to the kernel, allocations up to 32 MB
    # from the heap: tried against the worker's page faults during vLLM's reload; it left them
    # as they were (about 60k per push) and the reload no faster, so the library does not.
    "malloc-keep": {
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        "MALLOC_TOP_PAD_": str(64 << 20),
    },
    # every push through vLLM's own in-place reload (its layer-wise machinery), not the
    # library's fast full reload (periodic_rl.compat.vllm_fast_reload)
    "vllm-reload": {"PERIODIC_RL_VLLM_FAST_RELOAD": "0"},
    # full pushes copied through Ray's object store, not read by the worker in the trainer's
    # shared memory (periodic_rl.weight_sync.shared_memory)
    "object-store": {"PERIODIC_RL_SHARED_WEIGHTS": "0"},
    # the demo's default with each side's core loans off (CPUTuning's lend_idle_cores: false):
    # the worker loads pushes on its own core only, and the trainer steps on its own core only
    "no-loans": {},
}
#: ``CPUTuning`` arguments of a mode (the others run the demo's defaults).
MODE_TUNING: dict[str, dict[str, Any]] = {"no-loans": {"lend_idle_cores": False}}
TARGET_SHARE = 0.05  # the push at most 5% of an iteration
#: The phases of the table, in order: (column, key in an iteration's record).
PHASES = (
    ("optimizer step", "step_s"),
    ("step to push", "step_to_push_s"),
    ("export", "export_s"),
    ("put", "put_s"),
    ("hash done", "hash_done_s"),
    ("load", "load_s"),
    ("worker fetch", "fetch_s"),
    ("vLLM reload", "reload_s"),
    ("load cores", "load_cores"),
    ("verify", "verify_s"),
    ("reset", "reset_prefix_s"),
    ("worker page faults", "minor_faults"),
    ("load - worker", "load_overhead_s"),
    ("push", "push_s"),
    ("push to next generation", "push_to_generation_s"),
    ("step to next generation", "to_generation_s"),
    ("iteration", "iteration_s"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=6, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped at the start")
    p.add_argument("--modes", nargs="+", default=["default"], choices=list(MODES))
    p.add_argument("--max-new-tokens", type=int, default=24, help="the demo's 24")
    p.add_argument("--max-load", type=float, default=0.8, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for quiet")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds the fit may take")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "push.json")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: the fit
    return p.parse_args(argv)


def schedule(mode: str, iterations: int, warmup: int) -> list[dict[str, Any]]:
    """One fit's iterations: ``warmup`` dropped ones, then ``iterations`` measured."""
    return [{"mode": mode, "warmup": i < warmup} for i in range(warmup + iterations)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    machine = machine_info()
    settings = {
        **demo_settings(args.max_new_tokens),
        "modes": {mode: MODES[mode] for mode in args.modes},
        "mode_tuning": {m: MODE_TUNING[m] for m in args.modes if m in MODE_TUNING},
        "warmup_iterations": args.warmup,
    }
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}, git {machine['git']}")
    quiet = wait_for_quiet(args.max_load, args.max_wait)
    runs, iterations = [], []
    for mode in args.modes:
        plan = schedule(mode, args.iterations, args.warmup)
        print(f"{mode}: load average {load_average()}; {len(plan)} iterations")
        job = {"config": settings, "mode": mode, "schedule": plan}
        result = run_child(__file__, job, args.timeout)
        if not result.get("ok", True) or "iterations" not in result:
            print(result.get("error") or result.get("log_tail"))
            raise SystemExit(f"the fit of mode {mode} failed")
        runs.append(result)
        iterations += result["iterations"]
    summary = summarize(iterations, args.modes)
    table = results_table(summary)
    print_iterations(iterations)
    print("\n" + table + "\n\n" + summary["verdict"])
    data = {
        "benchmark": "push",
        "date": now_iso(),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine,
        "settings": settings,
        "load_before": quiet,
        "load_after": load_average(),
        "summary": summary,
        "table_markdown": table,
        "runs": runs,
    }
    print(f"\nwrote {write_json(args.output, data)}")


def summarize(iterations: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: the median of every phase over the measured iterations, and the push share
    (summed push seconds over summed iteration seconds)."""
    rows = {}
    for mode in modes:
        its = [it for it in iterations if it["mode"] == mode and not it["warmup"]]
        its = [it for it in its if "iteration_s" in it]
        row: dict[str, Any] = {"n": len(its)}
        for _, key in PHASES:
            values = [it[key] for it in its if it.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        total = sum(it["iteration_s"] for it in its)
        row["share"] = sum(it["push_s"] for it in its) / total if total else None
        rows[mode] = row
    verdicts = [
        f"{mode}: push {row['push_s']:.2f} s of {row['iteration_s']:.2f} s, "
        f"{row['share']:.1%} of the iterations (target <= {TARGET_SHARE:.0%}: "
        f"{'met' if row['share'] <= TARGET_SHARE else 'NOT met'})"
        for mode, row in rows.items()
        if row["share"] is not None
    ]
    return {"rows": rows, "target_share": TARGET_SHARE, "verdict": "; ".join(verdicts)}


def results_table(summary: dict[str, Any]) -> str:
    headers = ["mode", "n", *(name for name, _ in PHASES), "share"]
    rows = []
    for mode, row in summary["rows"].items():
        cells = ["-" if row[key] is None else round(row[key], 3) for _, key in PHASES]
        share = "-" if row["share"] is None else f"{row['share']:.1%}"
        rows.append([mode, row["n"], *cells, share])
    return markdown_table(headers, rows)


def print_iterations(iterations: list[dict[str, Any]]) -> None:
    keys = [key for _, key in PHASES]
    print("\niteration  mode      " + "  ".join(k.removesuffix("_s")[:8].rjust(8) for k in keys))
    for it in iterations:
        cells = "  ".join(
            f"{it[k]:8.3f}" if isinstance(it.get(k), int | float) else "       -" for k in keys
        )
        label = it["mode"] + ("*" if it["warmup"] else "")
        print(f"{it['iteration']:9d}  {label:8s}  {cells}")


# ---- the child: one fit ------------------------------------------------------------------------
def child_main(path: Path) -> None:
    job = json.loads(path.read_text())
    os.environ.update(MODES[job["mode"]])  # before Ray starts: its processes inherit them
    result = run_fit(job["config"], job["schedule"], MODE_TUNING.get(job["mode"], {}))
    path.write_text(json.dumps({**job, **result}))


def push_record(strategy: Any) -> dict[str, Any]:
    """The phases of the push that just ended (module docstring), from the spans and timings
    the trainer and the worker keep."""
    controller = strategy.rollouts
    backend = controller.backend
    spans = strategy.spans.spans(strategy.spans.iteration)
    step = [s for s in spans if s.lane == "trainer" and s.name == "optimizer step"][-1]
    push = [s for s in spans if s.lane == "trainer" and s.name == "weight push"][-1]
    timings = backend.timings
    (worker,) = backend.worker_load_timings()
    load = timings["last_push_load_s"]
    record = {
        "step_s": step.duration,  # what a push streamed during the step could hide behind
        "step_to_push_s": push.start - step.end,
        "export_s": controller.pusher.timings.get("export_s"),
        "send_s": controller.pusher.timings.get("send_s"),
        "backend_push_s": timings["last_push_s"],
        "put_s": timings["last_push_put_s"],
        "hash_done_s": timings["last_push_hash_done_s"],
        "load_s": load,
        "push_s": push.duration,
        "worker": worker,
        "load_overhead_s": load - worker.get("load_s", 0.0),
    }
    for key in ("fetch_s", "reload_s", "load_cores", "verify_s", "reset_prefix_s", "minor_faults"):
        record[key] = worker.get(key)
    generated = [s.start for s in spans if s.name == "generate"]
    record.update(
        step_end=step.end,
        push_end=push.end,
        first_generate=min(generated) if generated else None,
    )
    return record


def add_gaps(records: list[dict[str, Any]]) -> None:
    """Per iteration, from its step to the next iteration's first generation: the whole push
    on the critical path (``to_generation_s``), and the part after the trainer's push span
    ended (``push_to_generation_s``: the trainer's work between iterations, which the worker
    cannot use)."""
    for record, following in zip(records, records[1:], strict=False):
        start = following.get("first_generate")
        if start is not None and "step_end" in record:
            record["to_generation_s"] = start - record["step_end"]
            record["push_to_generation_s"] = start - record["push_end"]


def run_fit(
    config: dict[str, Any], plan: list[dict[str, Any]], tuning_kwargs: dict[str, Any]
) -> dict[str, Any]:
    import lightning as L

    class PushPlan(L.Callback):
        """Times each iteration and records its push."""

        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.records:
                self.records[-1]["iteration_s"] = now - self.records[-1]["start"]
            step = plan[len(self.records)]
            self.records.append({"iteration": len(self.records), **step, "start": now})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.records[-1].update(push_record(trainer.strategy))

        def on_train_end(self, trainer, pl_module) -> None:
            last = self.records[-1] if self.records else None
            if last is not None and "iteration_s" not in last:
                last["iteration_s"] = time.perf_counter() - last["start"]
            add_gaps(self.records)

    module, strategy, data = demo_parts(config, tuning_kwargs)
    pushes = PushPlan()
    trainer = bare_trainer(strategy, len(plan), [pushes])
    began = time.time()
    trainer.fit(module, datamodule=data)
    return {
        "ok": True,
        "fit_s": time.time() - began,
        "loadavg_end": list(os.getloadavg()),
        "iterations": pushes.records,
    }


if __name__ == "__main__":
    main()
