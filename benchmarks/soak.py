"""Soak: 200 iterations of a tiny model, workers SIGKILLed every ~20, against a fault-free run.

A real ``Trainer.fit`` (``PeriodicAsyncStrategy``, the HF engine in two Ray workers, overlapped,
a tiny random Llama built from a config with SmolLM2's tokenizer); a callback kills a random
worker near every ``--kill-every``-th iteration, at a random point of the iteration (before its
generation, after some of its micro-batches reached the trainer, or in the optimizer step),
and records every iteration. The same fit then runs without kills. Checked and written to the
JSON (``benchmarks/soak_run.py`` has the run and the checks):

* groups lost or duplicated: every job of every iteration trained exactly once, counted;
* each iteration's groups (job, seed, completions) and update (weights fingerprint, else a
  float64 digest of the update within ``DIGEST_RTOL``) equal to the fault-free run's;
* kills, restarts, calls sent again;
* resident memory of the trainer and of each worker after a warm-up (:func:`memory_growth`);
* processes and ``/dev/shm`` files left after each fit.

Run on a clean tree (the commit is recorded; a dirty tree is refused unless ``--allow-dirty``)::

    .venv/bin/python benchmarks/soak.py --iterations 200 --kill-every 20 --seed 0 \\
        --out benchmarks/results/soak.json

Re-tabulate and redraw a result file: ``.venv/bin/python benchmarks/soak.py --report FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, machine_info, markdown_table, now_iso, write_json  # noqa: E402

#: Memory growth allowed after warm-up (issue 14): 10 %.
MAX_GROWTH = 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--kill-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "images" / "soak_memory.png")
    p.add_argument("--warmup", type=int, default=20, help="iterations before memory is compared")
    p.add_argument("--window", type=int, default=20, help="iterations averaged per memory sample")
    p.add_argument("--model", help="a model directory (default: the tiny Llama, built here)")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes")
    p.add_argument("--report", type=Path, help="re-tabulate and redraw FILE; run nothing")
    return p.parse_args(argv)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def memory_growth(run: dict[str, Any], warmup: int, window: int) -> dict[str, Any]:
    """RSS growth after warm-up, as a fraction.

    Trainer, and each worker slot whatever incarnation: mean RSS of iterations ``warmup`` to
    ``warmup + window`` against the last ``window``. A killed worker's replacement starts
    small, so a slot's number alone could hide a leak; so also each worker incarnation (pid)
    that lived at least ``warmup + 2 * window`` iterations: its own samples from ``warmup``
    (its age) on, first ``window`` against last ``window``."""
    records = run["records"]
    n = len(records)
    span = (warmup, min(warmup + window, n)), (max(n - window, 0), n)

    def growth(series: list[float | None]) -> float | None:
        first = [v for v in series[span[0][0] : span[0][1]] if v is not None]
        last = [v for v in series[span[1][0] : span[1][1]] if v is not None]
        if not first or not last:
            return None
        return round(_mean(last) / _mean(first) - 1.0, 4)

    slots = len(records[0]["workers"]) if records else 0
    result: dict[str, Any] = {
        "warmup": warmup,
        "window": window,
        "trainer": growth([r["trainer_rss_mib"] for r in records]),
        "worker_slots": [
            growth([r["workers"][s]["rss_mib"] for r in records]) for s in range(slots)
        ],
    }
    incarnations: dict[int, list[float]] = {}
    for r in records:
        for w in r["workers"]:
            if w["rss_mib"] is not None:
                incarnations.setdefault(w["pid"], []).append(w["rss_mib"])
    result["worker_incarnations"] = {
        pid: round(_mean(s[-window:]) / _mean(s[warmup : warmup + window]) - 1.0, 4)
        for pid, s in incarnations.items()
        if len(s) >= warmup + 2 * window
    }
    measured = [result["trainer"], *result["worker_slots"], *result["worker_incarnations"].values()]
    result["max_growth"] = max((g for g in measured if g is not None), default=None)
    return result


def verdict(data: dict[str, Any]) -> dict[str, Any]:
    """Every check of issue 14, from the recorded runs."""
    faulty, clean = data["faulty"], data["fault_free"]
    growth = {run: data["memory"][run]["max_growth"] for run in ("faulty", "fault_free")}
    checks = {
        "no_group_lost_or_duplicated": all(
            c == {"lost": 0, "duplicated": 0} for c in data["groups"].values()
        ),
        "every_kill_restarted_once": faulty["restarts"] == len(faulty["kills"]) > 0,
        "updates_equal_fault_free": data["comparison"]["updates_equal"],
        "memory_flat": all(g is not None and g < MAX_GROWTH for g in growth.values()),
        "no_leftover_processes": not faulty["leftover_processes"]
        and not clean["leftover_processes"],
        "no_leftover_shm": not faulty["leftover_shm"] and not clean["leftover_shm"],
    }
    return {"passed": all(checks.values()), **checks}


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f}%"


def table(data: dict[str, Any]) -> str:
    runs = [data["faulty"], data["fault_free"]]
    mem = [data["memory"]["faulty"], data["memory"]["fault_free"]]
    groups = [data["groups"]["faulty"], data["groups"]["fault_free"]]
    c = data["comparison"]
    rows = [
        ("iterations", *(len(r["records"]) for r in runs)),
        ("workers killed", *(len(r["kills"]) for r in runs)),
        ("worker restarts", *(r["restarts"] for r in runs)),
        ("calls sent again", *(r["redispatched_calls"] for r in runs)),
        ("groups lost", *(g["lost"] for g in groups)),
        ("groups duplicated", *(g["duplicated"] for g in groups)),
        ("iterations with other groups", len(c["iterations_with_different_groups"]), "-"),
        ("iterations with another update", len(c["iterations_with_different_updates"]), "-"),
        ("trainer RSS growth", *(pct(m["trainer"]) for m in mem)),
        *(
            (f"worker {s} RSS growth (slot)", *(pct(m["worker_slots"][s]) for m in mem))
            for s in range(len(mem[0]["worker_slots"]))
        ),
        ("worker incarnations measured", *(len(m["worker_incarnations"]) for m in mem)),
        (
            "largest incarnation growth",
            *(pct(max(m["worker_incarnations"].values(), default=None)) for m in mem),
        ),  # fmt: skip
        ("processes left", *(len(r["leftover_processes"]) for r in runs)),
        ("/dev/shm files left", *(len(r["leftover_shm"]) for r in runs)),
        ("fit seconds", *(r["fit_s"] for r in runs)),
    ]
    return markdown_table(["", "with kills", "fault-free"], rows)


def draw(data: dict[str, Any], path: Path) -> Path | None:
    """Resident memory per iteration: trainer and each worker slot, both runs; kills marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no memory plot")
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run, style in (("faulty", "-"), ("fault_free", "--")):
        records = data[run]["records"]
        its = [r["iteration"] for r in records]
        label = "with kills" if run == "faulty" else "fault-free"
        top.plot(its, [r["trainer_rss_mib"] for r in records], style, label=f"trainer, {label}")
        for s in range(len(records[0]["workers"])):
            rss = [r["workers"][s]["rss_mib"] for r in records]
            bottom.plot(its, rss, style, label=f"worker {s}, {label}")
    for kill in data["faulty"]["kills"]:
        for ax in (top, bottom):
            ax.axvline(kill["iteration"], color="grey", alpha=0.3, linewidth=1)
    m = data["memory"]
    for ax in (top, bottom):
        ax.axvspan(m["faulty"]["warmup"], m["faulty"]["warmup"] + m["faulty"]["window"],
                   color="green", alpha=0.06)  # fmt: skip
        n = len(data["faulty"]["records"])
        ax.axvspan(n - m["faulty"]["window"], n, color="green", alpha=0.06)
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=7, loc="lower right")
    top.set_title(
        f"Soak: resident memory per iteration ({len(data['faulty']['kills'])} workers killed: "
        "grey lines; compared windows shaded)",
        fontsize=10,
    )
    bottom.set_xlabel("iteration")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(data: dict[str, Any], out: Path, plot: Path) -> None:
    data["memory"] = {
        run: memory_growth(data[run], data["warmup"], data["window"])
        for run in ("faulty", "fault_free")
    }
    data["verdict"] = verdict(data)
    data["table_markdown"] = table(data)
    print("\n" + data["table_markdown"])
    print("\n" + json.dumps(data["verdict"], indent=1))
    picture = draw(data, plot)
    if picture is not None:
        data["picture"] = (
            str(picture.relative_to(REPO)) if picture.is_relative_to(REPO) else str(picture)
        )
        print(f"wrote {picture}")
    print(f"wrote {write_json(out, data)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        finish(json.loads(args.report.read_text()), args.report, args.plot)
        return 0
    machine = machine_info()
    if machine["git"].get("dirty") and not args.allow_dirty:
        print("the tree has uncommitted changes: commit them (or pass --allow-dirty)")
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from soak_run import make_tiny_model, run_soak

    import periodic_rl

    began = time.time()
    with tempfile.TemporaryDirectory(prefix="prl-soak-model-") as tmp:
        model = args.model or make_tiny_model(tmp)
        result = run_soak(model, args.iterations, args.kill_every, args.seed)
    data = {
        "benchmark": "soak",
        "date": now_iso(),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": machine,
        "periodic_rl": str(Path(periodic_rl.__file__).parent),
        "wall_s": round(time.time() - began, 1),
        "warmup": args.warmup,
        "window": args.window,
        **result,
    }
    finish(data, args.out, args.plot)
    return 0 if data["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
