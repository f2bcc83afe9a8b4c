"""The summaries and markdown tables of ``benchmarks/vs_trl.py``, computed from the raw runs.

Nothing here imports torch: ``vs_trl.py --report`` re-tabulates a result file with these alone.
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table  # noqa: E402
from vs_trl_runs import CONFIGS  # noqa: E402


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
    print(
        "\nmean reward per optimizer step, the mean over seeds [min, max over seeds]; "
        "all steps, accuracy: each seed's mean over the steps:\n"
    )
    print(tables["reward_table_markdown"])
    print("\nwhere a measured step goes (medians over the measured steps, seconds):\n")
    print(tables["breakdown_markdown"])
    print("\n" + tables["verdict"])


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
    """Medians over the measured steps of every repeat, pooled (robust to one slow step); the
    rewards per step: means over seeds (:func:`rewards_by_seed`)."""
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
    rewards_by_seed(row, ok)
    row["mean_completion_tokens"] = median(
        [sum(r["completion_tokens"]) / sum(r["completions"]) for r in ok]
    )
    row["per_repeat"] = [
        {k: m[k] for k in ("s_per_step", "completions_per_s", "tokens_per_s", "step_s")}
        | {"repeat": r["repeat"], "seed": r.get("seed", 0)}
        for m, r in zip(ms, ok, strict=True)
    ]
    return row


def rewards_by_seed(row: dict[str, Any], ok: list[dict[str, Any]]) -> None:
    """Per step, the mean reward and accuracy of each seed (its runs averaged: result files
    from before per-repeat seeds ran every repeat with seed 0), then the mean over seeds and
    the range over seeds (None for a single seed)."""
    n = len(ok[0]["rewards"])

    def per_step(lists: list[list[float]]) -> list[float]:
        return [statistics.fmean(x[i] for x in lists) for i in range(n)]

    groups: dict[int, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(r.get("seed", 0), []).append(r)
    per_seed = [
        {
            "seed": seed,
            "runs": len(runs),
            "reward_per_step": per_step([r["rewards"] for r in runs]),
            "correct_per_step": per_step([r["correct"] for r in runs]),
        }
        for seed, runs in sorted(groups.items())
    ]
    rewards = [p["reward_per_step"] for p in per_seed]
    several = len(per_seed) > 1
    row["seeds"] = [r.get("seed", 0) for r in ok]
    row["per_seed"] = per_seed
    row["reward_per_step"] = per_step(rewards)
    row["reward_range_per_step"] = (
        [[min(x[i] for x in rewards), max(x[i] for x in rewards)] for i in range(n)]
        if several
        else None
    )
    row["correct_per_step"] = per_step([p["correct_per_step"] for p in per_seed])


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


def spread(values: list[float]) -> str:
    """The mean of ``values`` (one per seed) and, for several, their range: ``m [lo, hi]``."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    return f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def reward_table(summary: list[dict[str, Any]]) -> str:
    """Per config: each step's mean reward, the mean over seeds with the range over seeds, so
    that a difference between configs can be set against seed noise."""
    ok = [r for r in summary if r["ok"]]
    if not ok:
        return "(no successful run)"
    steps = len(ok[0]["reward_per_step"])
    headers = [
        "config", "seeds", *[f"step {i}" for i in range(steps)], "all steps",
        "accuracy (all steps)",
    ]  # fmt: skip
    rows = []
    for r in ok:
        seeds = r["per_seed"]
        rewards = [p["reward_per_step"] for p in seeds]
        rows.append(
            [
                r["config"],
                ", ".join(str(s) for s in r["seeds"]),
                *[spread([x[i] for x in rewards]) for i in range(steps)],
                spread([statistics.fmean(x) for x in rewards]),
                spread([statistics.fmean(p["correct_per_step"]) for p in seeds]),
            ]
        )
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


#: Resamples of the paired per-step ratios (:func:`versus_sync`); a fixed seed keeps reruns of
#: the report identical.
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0


def paired_ratios(sync: dict[str, Any], other: dict[str, Any]) -> list[float]:
    """``sync`` step time over ``other``'s, for every measured step both ran with the same
    repeat (seed) and step index: the same prompts and, for periodic_rl's configurations, the
    same update (so a pair differs in how, not what, it computed)."""
    mine = {r["repeat"]: r["step_s"] for r in other["per_repeat"]}
    return [
        a / b
        for r in sync["per_repeat"]
        for a, b in zip(r["step_s"], mine.get(r["repeat"], []), strict=False)
        if b > 0
    ]


def versus_sync(sync: dict[str, Any], other: dict[str, Any]) -> tuple[float, str, str]:
    """How fast ``other`` runs against the synchronous ``sync``: the ratio of median step times
    (> 1: faster), a verdict and the evidence behind it.

    The verdict reads the paired per-step ratios (:func:`paired_ratios`) and a 90% bootstrap
    interval of their median: ``SLOWER`` when the whole interval is below 1, ``not slower``
    when the ratio of medians is at least 1, and otherwise ``within noise`` (slower by the
    medians, but pairs of the same steps disagree: configurations that run the same split
    differ by this much from run to run)."""
    ratio = sync["s_per_step"] / other["s_per_step"]
    pairs = paired_ratios(sync, other)
    if not pairs:
        return ratio, "not slower" if ratio >= 1 else "SLOWER", "no paired steps"
    rng = random.Random(BOOTSTRAP_SEED)
    medians = sorted(
        statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(BOOTSTRAP_RESAMPLES)
    )
    low = medians[int(0.05 * (len(medians) - 1))]
    high = medians[int(0.95 * (len(medians) - 1))]
    if ratio >= 1:
        verdict = "not slower"
    elif high < 1:
        verdict = "SLOWER"
    else:
        verdict = "within noise"
    faster = sum(x >= 1 for x in pairs)
    evidence = (
        f"{len(pairs)} paired steps, {faster} as fast or faster; median pair ratio "
        f"{statistics.median(pairs):.2f}x, 90% interval {low:.2f}-{high:.2f}x"
    )
    return ratio, verdict, evidence


def target_verdict(summary: list[dict[str, Any]]) -> str:
    """The issue's two checks: the fastest periodic_rl configuration against TRL's default (a),
    at least 3x in completions/s; and the overlapped configurations against the synchronous
    one (c2), never slower (:func:`versus_sync`)."""
    by = {r["config"]: r for r in summary if r["ok"]}
    ours = [c for c in ("c", "c2", "d", "dl", "e") if c in by]
    lines = []
    if "a" in by and ours:
        best = max(ours, key=lambda c: by[c]["completions_per_s"])
        ratio = by[best]["completions_per_s"] / by["a"]["completions_per_s"]
        ratio_mean = by[best]["completions_per_s_mean"] / by["a"]["completions_per_s_mean"]
        reward_a = statistics.fmean(by["a"]["reward_per_step"])
        reward_best = statistics.fmean(by[best]["reward_per_step"])
        lines.append(
            f"target: the fastest periodic_rl configuration ({best}) "
            f"{by[best]['completions_per_s']:.3f} completions/s vs (a) "
            f"{by['a']['completions_per_s']:.3f} = {ratio:.2f}x "
            f"({'MET' if ratio >= 3 else 'NOT met'}: 3x; {ratio_mean:.2f}x from total times); "
            f"mean reward over the steps and seeds ({best}) {reward_best:.3f} vs (a) {reward_a:.3f}"
        )
    else:
        lines.append("target (>= 3x a in completions/s): not measured (a or periodic_rl missing)")
    for overlapped in ("d", "dl", "e"):
        if overlapped in by and "c2" in by:
            ratio, verdict, evidence = versus_sync(by["c2"], by[overlapped])
            lines.append(
                f"overlapped ({overlapped}) vs synchronous (c2): {ratio:.2f}x the speed "
                f"({verdict}; median s/step {by[overlapped]['s_per_step']:.1f} vs "
                f"{by['c2']['s_per_step']:.1f}; {evidence})"
            )
    if "d" in by and "dl" in by:
        ratio = by["d"]["s_per_step"] / by["dl"]["s_per_step"]
        lines.append(
            f"the trainer borrowing the idle worker core (dl) vs not (d): {ratio:.2f}x the speed "
            f"({'wins' if ratio > 1 else 'does NOT win'}; median s/step "
            f"{by['dl']['s_per_step']:.1f} vs {by['d']['s_per_step']:.1f})"
        )
    return "\n".join(lines)


def scan_table(points: list[dict[str, Any]], configs: list[str]) -> str:
    headers = ["workload", "prompt tokens", *[f"({c}) s/step" for c in configs]]
    overlapped = [c for c in ("d", "dl", "e", "k1", "f") if c in configs] or ["d"]
    headers += ["packing c->c2", *[f"overlap c2->{o}" for o in overlapped]]
    headers += [f"all a->{o}" for o in overlapped[:1]]
    rows = []
    for point in points:
        by = {r["config"]: r for r in point["summary"] if r["ok"]}
        cells = [fmt(by[c]["s_per_step"], ".1f") if c in by else "failed" for c in configs]

        tokens = next((r.get("prompt_tokens") for r in point["runs"] if r.get("ok")), None)
        rows.append(
            [point["name"], fmt(tokens, ".0f"), *cells]
            + [speedup(by, "c", "c2"), *[speedup(by, "c2", o) for o in overlapped]]
            + [speedup(by, "a", o) for o in overlapped[:1]]
        )
    return markdown_table(headers, rows)


def speedup(by: dict[str, dict[str, Any]], x: str, y: str) -> str:
    """How many times faster ``y`` steps than ``x``."""
    if x in by and y in by:
        return f"{by[x]['s_per_step'] / by[y]['s_per_step']:.2f}x"
    return "-"
