"""The numbers, tables and pictures of ``benchmarks/staleness.py`` from its raw runs.

A run is one ``fit`` (one ``max_staleness`` k, one seed). It keeps every timing span of the
strategy as ``[name, lane, start, end]`` (seconds from the run's first span) and, per iteration,
the callback's start and end times and the module's metrics. Everything below is computed from
those, so ``staleness.py --report FILE`` redraws and re-tabulates without running anything.

Spans are cut by **time**, not by their iteration tag: with k >= 1 the workers generate iteration
j + 1 .. j + k while the trainer trains j, so a generation span belongs to the time window it
falls in, whichever iteration it serves.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from common import markdown_table

TRAINER, WAIT, PUSH, SNAPSHOT, WORKER = "trainer", "wait", "weight push", "snapshot", "worker-"


def clipped(spans: list[list], t0: float, t1: float, keep=lambda s: True) -> list[tuple]:
    """``(start, end)`` of the spans that ``keep`` selects, cut to ``[t0, t1]``."""
    return [(max(s[2], t0), min(s[3], t1)) for s in spans if keep(s) and s[3] > t0 and s[2] < t1]


def measure(intervals: list[tuple]) -> float:
    """Length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def steady_window(run: dict[str, Any], warmup: int, tail: int) -> tuple[float, float, int]:
    """From the start of iteration ``warmup`` to the start of iteration ``N - tail``: whole
    periods (Lightning's work between iterations included), without the warm-up (compilation,
    the pipeline filling) and without the last ``tail`` iterations (with k >= 1 they were
    generated ahead, so the trainer runs them alone)."""
    its = run["iterations"]
    last = len(its) - tail
    if last - warmup < 1:
        raise ValueError(f"{len(its)} iterations leave none after {warmup} warm-up + {tail} tail")
    return its[warmup]["start"], its[last]["start"], last - warmup


def analyse(run: dict[str, Any], warmup: int, tail: int) -> dict[str, float]:
    """Seconds per iteration in the steady window, and where they went.

    generate: some worker generating. train: the trainer neither waiting for rollouts nor pushing
    (micro-batches, optimizer step, snapshot, everything else it does). push: any weight push
    (the trainer's, and the workers' loads). snapshot (k >= 1, part of train): the copy of the
    weights after each optimizer step. Idle shares: the fraction of the window a side does
    not do its own work (the trainer: train; a worker: generate), pushes included.
    """
    t0, t1, n = steady_window(run, warmup, tail)
    spans, wall = run["spans"], t1 - t0
    workers = sorted({s[1] for s in spans if s[1].startswith(WORKER)}) or [WORKER + "0"]
    per_worker = [measure(clipped(spans, t0, t1, lambda s, w=w: s[1] == w)) for w in workers]
    generate = measure(clipped(spans, t0, t1, lambda s: s[1].startswith(WORKER)))
    push = measure(clipped(spans, t0, t1, lambda s: s[0] == PUSH))
    blocked = measure(clipped(spans, t0, t1, lambda s: s[1] == TRAINER and s[0] in (WAIT, PUSH)))
    waiting = measure(clipped(spans, t0, t1, lambda s: s[1] == TRAINER and s[0] == WAIT))
    snapshot = measure(clipped(spans, t0, t1, lambda s: s[1] == TRAINER and s[0] == SNAPSHOT))
    train = wall - blocked
    out = {
        "iterations": n,
        "s_per_iter": wall / n,
        "generate": generate / n,
        "train": train / n,
        "push": push / n,
        "trainer_wait": waiting / n,
        "snapshot": snapshot / n,
        "trainer_idle_share": 1 - train / wall,
        "worker_idle_share": 1 - sum(per_worker) / (wall * len(workers)),
    }
    out["bound"] = max(out["generate"], out["train"])
    out["ideal"] = out["bound"] + out["push"]
    out["vs_ideal"] = out["s_per_iter"] / out["ideal"]
    out["vs_bound"] = out["s_per_iter"] / out["bound"]
    return out


def mean_range(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def metric_series(run: dict[str, Any], name: str) -> list[float]:
    return [it["metrics"].get(name, float("nan")) for it in run["iterations"]]


def summarize(runs: list[dict], ks: list[int], warmup: int, tail: int) -> list[dict[str, Any]]:
    """Per k: timing (mean and range over seeds), reward trajectory, staleness and mismatch."""
    rows = []
    ok = [r for r in runs if r.get("ok")]
    # the common bound: max(generate, train) of the same seed's k = 0 run
    base = {r["seed"]: analyse(r, warmup, tail)["bound"] for r in ok if r["max_staleness"] == 0}
    for k in ks:
        mine = [r for r in ok if r["max_staleness"] == k]
        if not mine:
            rows.append({"k": k, "seeds": 0})
            continue
        timing = [analyse(r, warmup, tail) for r in mine]
        for r, t in zip(mine, timing, strict=True):
            t["vs_k0_bound"] = t["s_per_iter"] / base[r["seed"]] if r["seed"] in base else None
        if any(t["vs_k0_bound"] is None for t in timing):
            for t in timing:
                del t["vs_k0_bound"]
        row: dict[str, Any] = {"k": k, "seeds": len(mine), "seed_list": [r["seed"] for r in mine]}
        for key in timing[0]:
            row[key] = mean_range([t[key] for t in timing])
        curves = [metric_series(r, "reward") for r in mine]
        length = min(len(c) for c in curves)
        per_it = [[c[i] for c in curves] for i in range(length)]
        row["reward_trajectory"] = [mean_range(v) for v in per_it]
        row["reward_all"] = mean_range([statistics.fmean(c[:length]) for c in curves])
        row["reward_last5"] = mean_range([statistics.fmean(c[length - 5 :]) for c in curves])
        lags: dict[str, list[float]] = {}
        for r in mine:
            for it in r["iterations"]:
                for name, value in it["metrics"].items():
                    if name.startswith("staleness/"):
                        lags.setdefault(name, []).append(value)
        total = sum(len(r["iterations"]) for r in mine)  # a lag absent in an iteration: 0 there
        row["staleness"] = {name: sum(v) / total for name, v in sorted(lags.items())}
        for name in ("mismatch/kl", "mismatch/abs_logp", "mismatch/tis_capped_frac"):
            values = [v for r in mine for v in metric_series(r, name) if v == v]
            row[name] = statistics.fmean(values) if values else None
        rows.append(row)
    return rows


def fmt_range(d: dict[str, float] | None, spec: str = ".2f") -> str:
    if not d:
        return "-"
    return f"{d['mean']:{spec}} ({d['min']:{spec}}-{d['max']:{spec}})"


def timing_table(summary: list[dict[str, Any]]) -> str:
    base = next((r for r in summary if r["k"] == 0 and r["seeds"]), None)
    headers = [
        "k", "s/iter (range over seeds)", "vs k=0", "generate", "train", "snapshot", "push",
        "trainer idle", "worker idle", "s/iter / (max(gen, train) + push)",
        "s/iter / max(gen, train)", "s/iter / k=0's max(gen, train)", "seeds",
    ]  # fmt: skip
    rows = []
    for r in summary:
        if not r["seeds"]:
            rows.append([r["k"], "failed", *["-"] * 11, 0])
            continue
        m = {key: r[key]["mean"] for key in r if isinstance(r[key], dict) and "mean" in r[key]}
        speed = f"{m['s_per_iter'] / base['s_per_iter']['mean']:.2f}x" if base else "-"
        rows.append(
            [
                r["k"], fmt_range(r["s_per_iter"], ".1f"), speed, m["generate"], m["train"],
                m["snapshot"], m["push"], f"{m['trainer_idle_share']:.0%}",
                f"{m['worker_idle_share']:.0%}", f"{m['vs_ideal']:.2f}x", f"{m['vs_bound']:.2f}x",
                f"{m['vs_k0_bound']:.2f}x" if "vs_k0_bound" in m else "-", r["seeds"],
            ]
        )  # fmt: skip
    return markdown_table(headers, rows)


def quality_table(summary: list[dict[str, Any]]) -> str:
    headers = [
        "k", "reward, all iterations", "reward, last 5", "staleness mean", "groups by lag",
        "mismatch/kl", "mismatch/abs_logp", "IS weights capped",
    ]  # fmt: skip

    def opt(v: float | None, spec: str) -> str:
        return "-" if v is None else f"{v:{spec}}"

    rows = []
    for r in summary:
        if not r["seeds"]:
            continue
        st = r["staleness"]
        hist = " / ".join(
            f"{lag.split('/')[1]}: {share:.0%}"
            for lag, share in st.items()
            if lag.split("/")[1].isdigit()
        )
        rows.append(
            [
                r["k"], fmt_range(r["reward_all"], ".3f"), fmt_range(r["reward_last5"], ".3f"),
                f"{st.get('staleness/mean', 0.0):.2f}", hist, opt(r["mismatch/kl"], ".2e"),
                opt(r["mismatch/abs_logp"], ".4f"), opt(r["mismatch/tis_capped_frac"], ".2%"),
            ]
        )  # fmt: skip
    return markdown_table(headers, rows)


def trajectory_table(summary: list[dict[str, Any]]) -> str:
    done = [r for r in summary if r["seeds"]]
    length = min((len(r["reward_trajectory"]) for r in done), default=0)
    headers = ["iteration", *[f"k={r['k']}: mean (min-max)" for r in done]]
    rows = [
        [i, *[fmt_range(r["reward_trajectory"][i], ".3f") for r in done]] for i in range(length)
    ]
    return markdown_table(headers, rows)


def verdict(summary: list[dict[str, Any]], target: float = 1.10) -> dict[str, Any]:
    by = {r["k"]: r for r in summary if r["seeds"]}
    out: dict[str, Any] = {"target": target}
    parts = []
    for k, r in sorted(by.items()):
        own = r["vs_bound"]["mean"]
        common = r["vs_k0_bound"]["mean"] if "vs_k0_bound" in r else float("nan")
        out[f"k{k}_vs_own_max_generate_train"] = own
        out[f"k{k}_vs_k0_max_generate_train"] = common
        parts.append(
            f"k={k}: {r['s_per_iter']['mean']:.1f} s/iter, {own:.2f}x its own max(gen, train), "
            f"{common:.2f}x k=0's"
        )
    if 1 in by:
        bounds = (("own", "vs_bound", "its own"), ("k0", "vs_k0_bound", "k=0's"))
        for name, key, whose in bounds:
            if key in by[1]:
                met = out[f"k1_met_{name}"] = by[1][key]["mean"] <= target
                parts.append(
                    f"k=1 within {target:.2f}x of {whose} max(gen, train): "
                    + ("MET" if met else "NOT met")
                )
    out["text"] = "; ".join(parts)
    return out


def draw_timelines(
    runs: list[dict], ks: list[int], out_dir: Path, warmup: int, tail: int, count: int, label: str
) -> list[Path]:
    """One Gantt chart per k: ``count`` iterations from ``warmup`` of its first seed's run."""
    from periodic_rl.callbacks.timeline import gantt_png
    from periodic_rl.rollout.timing import Span

    paths = []
    for k in ks:
        run = next((r for r in runs if r["max_staleness"] == k and r.get("ok")), None)
        if run is None:
            continue
        its = run["iterations"]
        first, last = warmup, min(warmup + count, len(its)) - 1
        t0, t1 = its[first]["start"], its[last]["end"]
        spans = [Span(s[0], s[1], a, b) for s in run["spans"] for a, b in clipped([s], t0, t1)]
        a = analyse(run, warmup, tail)
        title = (
            f"max_staleness={k}, seed {run['seed']}, iterations {first}-{last}{label}: "
            f"{a['s_per_iter']:.1f} s/iter, generate {a['generate']:.1f} s, "
            f"train {a['train']:.1f} s, push {a['push']:.1f} s"
        )
        starts = {i: its[i]["start"] for i in range(first, last + 1)}
        path = out_dir / f"staleness_timeline_k{k}.png"
        paths.append(gantt_png(spans, path, title, starts, "seconds"))
    return paths


def draw_rewards(summary: list[dict[str, Any]], path: Path, label: str) -> Path:
    """Mean reward per iteration with the range over seeds, one line per k."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in summary:
        if not r["seeds"]:
            continue
        traj = r["reward_trajectory"]
        xs = list(range(len(traj)))
        line = ax.plot(xs, [t["mean"] for t in traj], label=f"k={r['k']}")[0]
        lo, hi = [t["min"] for t in traj], [t["max"] for t in traj]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    seeds = max((r["seeds"] for r in summary), default=0)
    ax.set_title(f"reward per iteration: mean and range over {seeds} seed(s){label}", fontsize=10)
    ax.grid(linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
