"""An asynchrony budget against the fixed schedules, on the staleness benchmark's workload.

SmolLM2-135M-Instruct, full fine-tune in fp32, one vLLM rollout worker, ``builtin:arithmetic``,
4 prompts x 8 completions x at most 32 new tokens per iteration, micro-batches of 16, AdamW at
2e-5 (``benchmarks/staleness.py``'s settings, whose child runs each fit). Configurations:

- ``on-policy overlapped``: ``max_staleness: 0``, overlap, trainer on core 0, worker on core 1;
- ``on-policy turn-taking``: ``max_staleness: 0``, ``overlap: false``, both sides on every core;
- ``k=1``: ``max_staleness: 1``, overlap, trainer on core 0, worker on core 1;
- ``budget k<=1``: ``asynchrony: {max_staleness: 1}``, otherwise as ``k=1``: the run starts
  on-policy and the chooser picks its staleness from what it measures (its decisions are kept).

Seeds are the outer loop; the configurations' order is reversed every other seed. Measured per
run: seconds per iteration from the start of iteration ``warmup`` to the start of iteration
``N - tail`` (the chooser's on-policy window and switch fall inside it: choosing is part of the
cost), and the reward of every iteration. Ratios are per seed against the best strictly on-policy
configuration (the faster of the first two, by their mean over seeds).

Full run (the three default configurations, 3 seeds: about 45 minutes on the 2-core machine;
writes the JSON and ``docs/asynchrony_benchmark.md``)::

    .venv/bin/python benchmarks/asynchrony.py

Re-tabulate a result file and rewrite the page without running anything::

    .venv/bin/python benchmarks/asynchrony.py --report benchmarks/results/asynchrony.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import (  # noqa: E402
    REPO,
    RESULTS_DIR,
    load_average,
    machine_info,
    markdown_table,
    now_iso,
    write_json,
    write_page,
)
from staleness import parse_args as staleness_args  # noqa: E402
from staleness import settings_of  # noqa: E402
from staleness_report import analyse, fmt_range, mean_range, metric_series  # noqa: E402

STALENESS = Path(__file__).resolve().parent / "staleness.py"
PAGE = REPO / "docs" / "asynchrony_benchmark.md"
ON_POLICY = ("on-policy overlapped", "on-policy turn-taking")
CONFIGS: dict[str, dict[str, Any]] = {
    "on-policy overlapped": {"max_staleness": 0},
    "on-policy turn-taking": {
        "max_staleness": 0, "overlap": False, "trainer_cores": None, "worker_cores": None
    },
    "k=1": {"max_staleness": 1},
    "budget k<=1": {"max_staleness": 0, "asynchrony": {"max_staleness": 1}},
    "k=1, every core": {
        "max_staleness": 1, "overlap": False, "trainer_cores": None, "worker_cores": None
    },
    "budget k<=1, every core": {
        "max_staleness": 0, "asynchrony": {"max_staleness": 1}, "overlap": False,
        "trainer_cores": None, "worker_cores": None,
    },
}  # fmt: skip
#: ``on-policy overlapped`` is the budget run's own starting point (the staleness benchmark's
#: k = 0); on this machine turn-taking on every core is the faster on-policy configuration.
DEFAULT_CONFIGS = ["on-policy turn-taking", "k=1", "budget k<=1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tail", type=int, default=1)
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "asynchrony.json")
    p.add_argument("--report", type=Path, help="re-tabulate FILE and rewrite the page")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report is not None:
        data = json.loads(args.report.read_text())
        finish(data, args.report)
        return
    machine = machine_info()
    print(f"git: {machine['git']}" + ("  (uncommitted!)" if machine["git"].get("dirty") else ""))
    base = staleness_args(["--iterations", str(args.iterations), "--warmup", str(args.warmup)])
    settings = {**settings_of(base), "tail_iterations": args.tail}
    began, runs = time.time(), []
    for n, seed in enumerate(args.seeds):
        for name in args.configs if n % 2 == 0 else args.configs[::-1]:
            quiet = wait_for_quiet(args.max_load, args.max_wait)
            print(f"\n== seed {seed}, {name}; load {quiet['load_average']}", flush=True)
            config = {**settings, **CONFIGS[name], "config": name, "seed": seed}
            result = run_child(STALENESS, config, args.timeout, prefix="prl-asynchrony-")
            result["load_before"] = quiet
            runs.append(result)
            print(result.get("error", "")[-2000:] if not result.get("ok") else "ok", flush=True)
            for line in result.get("decisions", []):
                print("  " + line)
    data = {
        "benchmark": "asynchrony",
        "date": now_iso(),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": machine,
        "settings": settings,
        "configs": args.configs,
        "seeds": args.seeds,
        "wall_s": round(time.time() - began, 1),
        "load_after": load_average(),
        "runs": runs,
    }
    finish(data, args.output)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: s/iteration, the per-seed ratio to the best on-policy configuration,
    and the rewards; and the verdict on the budget run."""
    s = data["settings"]
    ok = [r for r in data["runs"] if r.get("ok")]
    pace = {(r["config"], r["seed"]): analyse(r, s["warmup_iterations"], s["tail_iterations"])
            for r in ok}  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for name in data["configs"]:
        mine = [r for r in ok if r["config"] == name]
        if not mine:
            continue
        curves = [metric_series(r, "reward") for r in mine]
        rows[name] = {
            "seeds": [r["seed"] for r in mine],
            "s_per_iter": mean_range([pace[name, r["seed"]]["s_per_iter"] for r in mine]),
            "reward_all": mean_range([statistics.fmean(c) for c in curves]),
            "reward_per_iteration": [mean_range(list(v)) for v in zip(*curves, strict=False)],
            "decisions": {str(r["seed"]): r.get("decisions", []) for r in mine},
        }
    measured = [n for n in ON_POLICY if n in rows]
    best = min(measured, key=lambda n: rows[n]["s_per_iter"]["mean"]) if measured else None
    for name, row in rows.items():
        ratios = [pace[best, seed]["s_per_iter"] / pace[name, seed]["s_per_iter"]
                  for seed in row["seeds"] if (best, seed) in pace]  # fmt: skip
        row["speedup_vs_best_on_policy"] = mean_range(ratios) if ratios else None
    verdict = None
    budget, base = rows.get("budget k<=1"), rows.get(best) if best else None
    if budget and budget["speedup_vs_best_on_policy"] and base:
        inside = sum(
            lo["min"] <= b["mean"] <= lo["max"]
            for b, lo in zip(budget["reward_per_iteration"], base["reward_per_iteration"],
                             strict=False)
        )  # fmt: skip
        n = min(len(budget["reward_per_iteration"]), len(base["reward_per_iteration"]))
        speedup = budget["speedup_vs_best_on_policy"]["mean"]
        verdict = {
            "speedup_vs_best_on_policy": speedup,
            "best_on_policy": best,
            "target_speedup": 1.3,
            "speedup_met": speedup >= 1.3,
            "reward_iterations_inside_k0_range": inside,
            "reward_iterations": n,
        }
    return {"best_on_policy": best, "rows": rows, "verdict": verdict}


def page(data: dict[str, Any], summary: dict[str, Any]) -> str:
    rows = summary["rows"]
    table = markdown_table(
        ["configuration", "s/iteration (range over seeds)", "vs best on-policy", "mean reward"],
        [
            [name, fmt_range(r["s_per_iter"]), fmt_range(r["speedup_vs_best_on_policy"]) + "x"
             if r["speedup_vs_best_on_policy"] else "-", fmt_range(r["reward_all"], ".3f")]
            for name, r in rows.items()
        ],
    )  # fmt: skip
    git = data["machine"]["git"]
    lines = [
        "# Benchmark: an asynchrony budget against the fixed schedules",
        "",
        f"Generated by `benchmarks/asynchrony.py --report` from `benchmarks/results/"
        f"asynchrony.json`: run of {data['date'][:10]}, commit {git['commit'][:12]}"
        + (" (uncommitted changes)" if git.get("dirty") else "")
        + f", `{data['command']}`.",
        "",
        (__doc__ or "").split("\n\n")[1].replace("\n", " "),
        "",
        table,
        "",
    ]
    v = summary["verdict"]
    if v:
        lines += [
            f"The budget run made {v['speedup_vs_best_on_policy']:.2f}x the pace of the best "
            f"strictly on-policy configuration ({v['best_on_policy']}); target 1.3x: "
            + ("met." if v["speedup_met"] else "**not met**.")
            + f" In {v['reward_iterations_inside_k0_range']} of {v['reward_iterations']} "
            f"iterations its mean reward over seeds lies within the range of the "
            f"{v['best_on_policy']} runs' rewards.",
            "",
        ]
    budget = rows.get("budget k<=1")
    if budget:
        lines += ["The chooser's decisions, per seed:", ""]
        for seed, decisions in budget["decisions"].items():
            lines += [f"- seed {seed}:"] + [f"  - `{d}`" for d in decisions]
        lines.append("")
    return "\n".join(lines)


def finish(data: dict[str, Any], path: Path) -> None:
    summary = summarize(data)
    data["summary"] = summary
    if summary["verdict"]:
        data["speedup_vs_best_on_policy"] = summary["verdict"]["speedup_vs_best_on_policy"]
    text = page(data, summary)
    print(text)
    print(f"wrote {write_json(path, data)}")
    write_page(PAGE, text + "\n", check=False)


if __name__ == "__main__":
    main()
