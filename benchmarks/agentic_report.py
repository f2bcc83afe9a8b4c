"""The numbers, tables and page of ``benchmarks/agentic.py``, computed from its raw runs.

Nothing here imports torch: ``agentic.py --report FILE`` re-tabulates a result file, and this
script regenerates ``docs/agentic_benchmark.md`` from one (the same JSON gives the same bytes;
``--check`` exits 1 when the page on disk differs, as ``benchmarks/benchmarks_doc.py`` does)::

    .venv/bin/python benchmarks/agentic_report.py             # rewrite docs/agentic_benchmark.md
    .venv/bin/python benchmarks/agentic_report.py --check     # is the page current?

from ``benchmarks/results/agentic.json`` (the full run), or ``agentic_quick.json`` (the smoke
run, labelled as such on the page) while there is no full run; ``--input FILE`` for another.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, markdown_table, write_page  # noqa: E402

CONFIGS = {
    "trl": "TRL GRPOTrainer, environment_factory, transformers generate",
    "turns": "periodic_rl turn-taking (overlap=False), Ray vLLM worker",
    "overlap": "periodic_rl overlapped (overlap=True), Ray vLLM worker on core 1",
}
WHAT = {
    "trl": "TRL `GRPOTrainer(environment_factory=ToolDesk)` ({trl}), its default generation "
    "(transformers `generate`), `use_cpu=True`, torch on every core; tool calls run in its "
    "training process, one after another",
    "turns": "periodic_rl `PeriodicAsyncStrategy(overlap=False)`, one Ray vLLM worker; the worker "
    "(pinned to every core) and the trainer (every core) take turns",
    "overlap": "periodic_rl `PeriodicAsyncStrategy(overlap=True)`, one Ray vLLM worker; "
    "`CPUTuning(trainer_cores=[0], worker_cores=[[1]])` (the demo's placement; the trainer "
    "borrows the worker's core once it has generated the iteration, the default)",
}
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "agentic_benchmark.md"


# ---- numbers ---------------------------------------------------------------------------------
def measured(run: dict[str, Any]) -> dict[str, Any]:
    """One run's iterations after the first (warm-up). Iteration i lasts from the end of
    iteration i-1 to its own end (whatever the framework does between iterations included)."""
    ends = run["iteration_end"]
    durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    completions = run["completions"][1:]
    return {
        "iteration_s": durations,
        "completions": completions,
        "completions_per_s": sum(completions) / sum(durations),
        "completions_per_s_median_iteration": statistics.median(
            c / d for c, d in zip(completions, durations, strict=True)
        ),
    }


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def per_seed(run: dict[str, Any]) -> dict[str, Any]:
    """What a run (one configuration, one seed) measured."""
    m = measured(run)
    row = {
        "seed": run["seed"],
        "completions_per_s": m["completions_per_s"],
        "completions_per_s_median_iteration": m["completions_per_s_median_iteration"],
        "s_per_iteration": statistics.fmean(m["iteration_s"]),
        "iteration_s": m["iteration_s"],
        "mean_reward": _mean(run["rewards"]),  # every iteration, warm-up included
        "reward_per_iteration": run["rewards"],
        "tool_calls_per_trajectory": _mean(run["tool_calls_per_trajectory"]),
        "tool_failure_share": _mean(run["tool_failure_share"]),
        "model_tokens_per_trajectory": _mean(run["model_tokens_per_trajectory"]),
        "tool_s_per_call": run["tool_s_total"] / run["tool_calls_total"]
        if run.get("tool_calls_total")
        else None,
        "startup_s": run["startup_s"],
        "peak_tree_pss_gib": run.get("peak_tree_pss_gib"),
        "generate_s": statistics.median(run["generate_s"][1:]) if run.get("generate_s") else None,
    }
    if run.get("train_s"):
        row["train_s"] = statistics.median(run["train_s"][1:])
    if run.get("engine_idle_s"):
        row["engine_idle_s"] = statistics.median(run["engine_idle_s"][1:])
    return row


def summarize(cfg: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration over its seeds: completions/s from the total time of every measured
    iteration of every seed; the median iteration's; the mean reward (the mean over seeds of
    each seed's mean over its iterations) with its range over seeds."""
    ok = [r for r in runs if r.get("ok")]
    row: dict[str, Any] = {"config": cfg, "label": CONFIGS[cfg], "runs": len(runs), "ok": len(ok)}
    if not ok:
        errors = [r.get("error", "") for r in runs]
        row["error"] = errors[0] if errors else "not run"
        return row
    ms = [measured(r) for r in ok]
    seeds = [per_seed(r) for r in ok]
    durations = [d for m in ms for d in m["iteration_s"]]
    completions = [c for m in ms for c in m["completions"]]
    rewards = [s["mean_reward"] for s in seeds]
    row |= {
        "measured_iterations": len(durations),
        "completions_per_s": sum(completions) / sum(durations),
        "completions_per_s_median_iteration": statistics.median(
            c / d for c, d in zip(completions, durations, strict=True)
        ),
        "s_per_iteration": statistics.fmean(durations),
        "mean_reward": _mean(rewards),
        "reward_range": [min(rewards), max(rewards)],
        "tool_calls_per_trajectory": _mean([s["tool_calls_per_trajectory"] for s in seeds]),
        "tool_failure_share": _mean([s["tool_failure_share"] for s in seeds]),
        "model_tokens_per_trajectory": _mean([s["model_tokens_per_trajectory"] for s in seeds]),
        "tool_s_per_call": _mean([s["tool_s_per_call"] for s in seeds]),
        "startup_s": statistics.median(s["startup_s"] for s in seeds),
        "peak_tree_pss_gib": max(s["peak_tree_pss_gib"] or 0.0 for s in seeds),
        "generate_s": _mean([s["generate_s"] for s in seeds]),
        "train_s": _mean([s.get("train_s") for s in seeds]),
        "engine_idle_s": _mean([s.get("engine_idle_s") for s in seeds]),
        "per_seed": seeds,
    }
    return row


def speedup(by: dict[str, dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    """``num``'s completions/s over ``den``'s: from the pooled totals, and per seed (the runs
    that drew with the same seed), with both sides' mean rewards beside each ratio."""
    if num not in by or den not in by:
        return None
    a, b = by[num], by[den]
    theirs = {s["seed"]: s for s in b["per_seed"]}
    seeds = []
    for mine in a["per_seed"]:
        other = theirs.get(mine["seed"])
        if other is None:
            continue
        seeds.append(
            {
                "seed": mine["seed"],
                "ratio": mine["completions_per_s"] / other["completions_per_s"],
                f"{num}_completions_per_s": mine["completions_per_s"],
                f"{den}_completions_per_s": other["completions_per_s"],
                f"{num}_mean_reward": mine["mean_reward"],
                f"{den}_mean_reward": other["mean_reward"],
                f"{num}_tool_calls_per_trajectory": mine["tool_calls_per_trajectory"],
                f"{den}_tool_calls_per_trajectory": other["tool_calls_per_trajectory"],
            }
        )
    ratios = [s["ratio"] for s in seeds]
    return {
        "of": num,
        "over": den,
        "value": a["completions_per_s"] / b["completions_per_s"],
        "median_iteration": a["completions_per_s_median_iteration"]
        / b["completions_per_s_median_iteration"],
        "geometric_mean_of_seeds": math.exp(statistics.fmean(math.log(r) for r in ratios))
        if ratios
        else None,
        "range_over_seeds": [min(ratios), max(ratios)] if ratios else None,
        "per_seed": seeds,
        "mean_reward": {num: a["mean_reward"], den: b["mean_reward"]},
        "reward_range": {num: a["reward_range"], den: b["reward_range"]},
    }


def tables(runs: list[dict[str, Any]], configs: dict[str, str] | list[str]) -> dict[str, Any]:
    """Everything the result file holds besides its raw runs and settings."""
    summary = [summarize(c, [r for r in runs if r["config"] == c]) for c in configs]
    by = {r["config"]: r for r in summary if r["ok"]}
    return {
        "speedup_vs_trl": speedup(by, "overlap", "trl"),
        "speedup_vs_turn_taking": speedup(by, "overlap", "turns"),
        "summary": summary,
        "table_markdown": results_table(summary),
        "per_seed_markdown": seed_table(summary),
    }


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def results_table(summary: list[dict[str, Any]]) -> str:
    base = {r["config"]: r for r in summary if r["ok"]}
    rows = []
    for r in summary:
        if not r["ok"]:
            rows.append([r["config"], r["label"], "failed", *[""] * 10])
            continue
        vs = {k: r["completions_per_s"] / base[k]["completions_per_s"] for k in base}
        lo, hi = r["reward_range"]
        rows.append(
            [
                r["config"],
                r["label"],
                _f(r["completions_per_s"], ".3f"),
                f"{vs['trl']:.2f}x" if "trl" in vs else "-",
                f"{vs['turns']:.2f}x" if "turns" in vs else "-",
                _f(r["completions_per_s_median_iteration"], ".3f"),
                _f(r["s_per_iteration"], ".1f"),
                f"{r['mean_reward']:.3f} [{lo:.3f}, {hi:.3f}]",
                _f(r["tool_calls_per_trajectory"]),
                _f(r["tool_failure_share"]),
                _f(r["model_tokens_per_trajectory"], ".1f"),
                _f(r["startup_s"], ".1f"),
                f"{r['ok']}/{r['runs']}",
            ]
        )
    headers = [
        "config",
        "what",
        "completions/s",
        "vs trl",
        "vs turns",
        "completions/s (median iteration)",
        "s/iteration",
        "mean reward [min, max over seeds]",
        "tool calls/trajectory",
        "failed share",
        "model tokens/trajectory",
        "start-up s",
        "runs",
    ]
    return markdown_table(headers, rows)


def seed_table(summary: list[dict[str, Any]]) -> str:
    rows = []
    for r in summary:
        for s in r.get("per_seed", []):
            rows.append(
                [
                    r["config"],
                    s["seed"],
                    _f(s["completions_per_s"], ".3f"),
                    " ".join(f"{x:.1f}" for x in s["iteration_s"]),
                    _f(s["mean_reward"], ".3f"),
                    " ".join(f"{x:.2f}" for x in s["reward_per_iteration"]),
                    _f(s["tool_calls_per_trajectory"]),
                    _f(s["tool_s_per_call"]),
                    _f(s["generate_s"], ".1f"),
                    _f(s.get("train_s"), ".1f"),
                    _f(s.get("engine_idle_s"), ".1f"),
                    _f(s["peak_tree_pss_gib"]),
                ]
            )
    headers = [
        "config",
        "seed",
        "completions/s",
        "measured iterations, s",
        "mean reward",
        "reward per iteration",
        "tool calls/trajectory",
        "s per tool call",
        "generate s (median)",
        "train s (median)",
        "engine idle s (median)",
        "peak PSS GiB (tree)",
    ]
    return markdown_table(headers, rows)


def speedup_words(s: dict[str, Any] | None, name: str) -> str | None:
    if s is None:
        return None
    seeds = ", ".join(
        f"seed {p['seed']} {p['ratio']:.2f}x (rewards {p[s['of'] + '_mean_reward']:.3f} vs "
        f"{p[s['over'] + '_mean_reward']:.3f})"
        for p in s["per_seed"]
    )
    return (
        f"({s['of']}) against {name} ({s['over']}): **{s['value']:.2f}x** the completions per "
        f"second (total time of the measured iterations; {s['median_iteration']:.2f}x by the "
        f"median iteration); per seed: {seeds}."
    )


def print_tables(data: dict[str, Any]) -> None:
    print("\n" + data["table_markdown"] + "\n\n" + data["per_seed_markdown"] + "\n")
    for key, name in (("speedup_vs_trl", "TRL"), ("speedup_vs_turn_taking", "turn-taking")):
        words = speedup_words(data.get(key), name)
        print(words if words else f"{key}: not measured")


# ---- the page ----------------------------------------------------------------------------------
def wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(
        text, 96, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def generate(data: dict[str, Any], path: Path) -> str:
    """The page of one result file (its tables recomputed from the raw runs)."""
    data = {**data, **tables(data["runs"], data["configs"])}
    s, m, git = data["settings"], data["machine"], data.get("git") or data["machine"]["git"]
    commit, dirty = (git.get("commit") or "unknown")[:7], str(git.get("dirty")).lower()
    n_seeds, order = len(s["seeds"]), []
    for seed in s["seeds"]:
        order.append(", ".join(r["config"] for r in data["runs"] if r["seed"] == seed))
    parts = ["# Benchmark: multi-turn tool rollouts with tool latency"]
    parts.append(
        wrap(
            f"Generated by `benchmarks/agentic_report.py` from `{rel(path)}` on "
            f"{data['date'][:10]}; commit {commit} (git dirty: {dirty}). Do not edit it by "
            "hand: rerun the benchmark, then the script."
        )
    )
    if data.get("quick"):
        parts.append(
            wrap(
                "**A quick smoke run** (`--quick`: one seed, two iterations, a tiny batch): it "
                "shows the script working end to end; one measured iteration per run is not a "
                "measurement to quote. The full benchmark: `.venv/bin/python "
                "benchmarks/agentic.py` on a clean tree (it writes "
                "`benchmarks/results/agentic.json`, which this page then comes from)."
            )
        )
    if git.get("dirty"):
        parts.append(
            wrap(
                "**Measured on a tree with uncommitted changes** (`--allow-dirty`): the commit "
                "above does not hold exactly the code that ran."
            )
        )
    bullets = [
        speedup_words(data.get("speedup_vs_trl"), "TRL"),
        speedup_words(data.get("speedup_vs_turn_taking"), "turn-taking"),
    ]
    same = all(r.get("same_prompt_tokens") for r in data["runs"] if r.get("ok"))
    bullets.append(
        f"Every configuration {'saw' if same else '**did not see**'} the same prompt token ids "
        f"({data['runs'][0].get('prompt_tokens', '?')} tokens for the first prompt)."
    )
    short = (
        f"**The short version.** On the {m['nproc']}-core CPU machine, `{s['model']}` fp32, "
        f"{s['prompts_per_iteration']} prompts x {s['num_generations']} trajectories per "
        f"iteration, at most {s['max_turns']} model turns and {s['max_new_tokens']} model "
        f"tokens per trajectory, {n_seeds} seed{'s' * (n_seeds != 1)}:"
    )
    parts.append(wrap(short) + "\n\n" + "\n".join(wrap("- " + b, "  ") for b in bullets if b))
    parts.append("## What was run")
    lines = [
        "```bash",
        data["command"] + f"   # {data['wall_s'] / 60:.0f} min",
        f".venv/bin/python benchmarks/agentic.py --report {rel(path)}   # re-tabulate",
        ".venv/bin/python benchmarks/agentic_report.py"
        + ("" if path.resolve() == default_input().resolve() else f" --input {rel(path)}")
        + "   # regenerate this page",
        "```",
    ]
    parts.append("\n".join(lines))
    parts.append(
        wrap(
            "Each configuration runs in its own fresh interpreter; per seed the configurations "
            f"run one after another, each seed starting one later: {' | '.join(order)}. "
            f"{s['iterations']} iterations per run (one optimizer step each); the first is "
            "warm-up and not counted. Completions per second: the trajectories of the measured "
            "iterations over their total time (an iteration runs from the end of the previous "
            "one to its own end). Rewards: the mean over every iteration, warm-up included."
        )
    )
    versions = m["versions"]
    config_rows = [
        [c, CONFIGS[c], WHAT[c].format(trl=versions.get("trl"))] for c in data["configs"]
    ]
    parts.append(markdown_table(["config", "in the tables", "what"], config_rows))
    lat = s["tool_latency"]
    held = [
        "the model: `smollm2-135m-instruct` (`periodic_rl.models.resolve_model`), fp32 weights, "
        "fp32 engine;",
        "the environment: `benchmarks/agentic_env.py:ToolDesk`, TRL's `environment_factory` "
        "contract (no-argument constructor, `reset(**row)`, public methods as tools with Google "
        "docstrings), unchanged on both sides. Its tools: `python(code)`, run in the sandbox of "
        f"`periodic_rl.run_python` (wall limit {s['tool_timeout_s']:.0f} s); "
        f"`calculator(expression)`, a remote service that sleeps a {lat['distribution']} latency "
        f"(median {lat['median_s']} s, log-sd {lat['sigma']}, capped at {lat['cap_s']} s; seeded "
        f"by seed {lat['seed']}, the {lat['keyed_by']}) before it answers;",
        "the chat template: " + s["chat_template"] + "; tool calls " + s["tool_call_format"] + ";",
        f"the prompts: {s['prompts']} (the system prompt, then the exchanges, then the question);",
        f"the limits: {s['max_turns']} model turns (TRL `max_tool_calling_iterations="
        f"{s['max_tool_calling_iterations']}`), {s['max_new_tokens']} tokens per trajectory "
        "(`max_new_tokens`, TRL `max_completion_length`), each tool's own time limit;",
        f"the reward: {s['reward']};",
        f"sampling: G = {s['num_generations']}, temperature {s['temperature']}, top-p "
        f"{s['top_p']}; the loss: `{s['loss_type']}`, beta {s['beta']}, epsilon {s['epsilon']}, "
        f"{s['scale_rewards']}-scaled advantages; AdamW, learning rate {s['learning_rate']:g} "
        f"constant, gradient clip {s['max_grad_norm']}; {s['micro_batch']}; one optimizer step "
        "per iteration;",
        f"repeat r samples with seed r on every side (seeds {s['seeds']}).",
    ]
    parts.append("**Held equal:**\n\n" + "\n".join(wrap("- " + h, "  ") for h in held))
    parts.append(
        "**Not equal** (what the frameworks do differently):\n\n"
        + "\n".join(wrap("- " + d + ".", "  ") for d in s["differences"])
    )
    parts.append("## Results")
    parts.append(data["table_markdown"])
    parts.append(
        wrap(
            "Tool calls: TRL counts the calls its parser read (and ran); periodic_rl also "
            "counts the calls it could not parse (answered with the parse error), hence their "
            "failed share. Per run: the measured iterations; seconds per tool call (TRL: each "
            "call it ran; periodic_rl: each turn's calls together, running concurrently, parse "
            "errors included); generation (TRL: its `_generate`, every turn and tool call of "
            "the iteration; periodic_rl: the worker's generation spans) and training times "
            "(TRL: the rest of the step), medians over the measured iterations; engine idle: "
            "time the periodic_rl engine had nothing to generate, every unfinished trajectory "
            "waiting on a tool."
        )
    )
    parts.append(data["per_seed_markdown"])
    loads = [r["load_at_start"][0] for r in data["runs"] if r.get("load_at_start")]
    machine = (
        f"Measured on {m['nproc']} x {m['cpu_model']} ({m.get('memory_gib')} GiB), "
        f"{m['platform']}, Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        + f". Load average before the runs {data['load_before']['load_average'][0]} (waited "
        f"{data['load_before']['waited_s']:.0f} s for at most {data['load_before']['max_load']}"
        f"), after {data['load_after'][0]}; at each run's start "
        f"{min(loads):.2f}-{max(loads):.2f}."
    )
    parts.append("## Machine\n\n" + wrap(machine))
    return "\n\n".join(parts) + "\n"


def default_input() -> Path:
    """``agentic.json`` (the full run); ``agentic_quick.json`` while there is none."""
    full = RESULTS / "agentic.json"
    return full if full.exists() else RESULTS / "agentic_quick.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=Path, default=None, help="default: agentic.json, else quick")
    p.add_argument("--output", type=Path, default=PAGE)
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    args = p.parse_args(argv)
    args.input = args.input or default_input()
    page = generate(json.loads(args.input.read_text()), args.input)
    return write_page(args.output, page, args.check)


if __name__ == "__main__":
    sys.exit(main())
