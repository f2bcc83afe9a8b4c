"""The tables and verdicts of ``benchmarks/overlap.py``: per-mode medians of its iterations, the
synchronous bound (each side measured alone), and whether overlap comes within 15% of it."""

from __future__ import annotations

import statistics
from typing import Any

from common import markdown_table


def mode_key(it: dict[str, Any]) -> tuple[int, int, bool]:
    return (it["groups_per_call"], it["micro_batch_size"], it["overlap"])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


SUMMARY_KEYS = [
    "seconds", "generate", "train", "micro_batches", "step", "push", "trainer_idle",
    "worker_idle", "first_wait", "train_after_generation", "ideal", "vs_ideal",
    "overlap_ratio", "tokens",
]  # fmt: skip


def summarize_mode(run: dict[str, Any], calls: int, micro: int, overlap: bool) -> dict[str, Any]:
    its = [
        it
        for it in run["iterations"]
        if mode_key(it) == (calls, micro, overlap) and not it["warmup"]
    ]
    row: dict[str, Any] = {
        "placement": run["placement"],
        "groups_per_call": calls,
        "micro_batch_size": micro,
        "mode": "overlap" if overlap else "sync",
        "n": len(its),
    }
    for key in SUMMARY_KEYS:
        row[key] = median([it[key] for it in its])
    return row


def find(summary: list[dict], placement: str, calls: int, micro: int, mode: str) -> dict:
    return next(
        r
        for r in summary
        if (r["placement"], r["groups_per_call"], r["micro_batch_size"], r["mode"])
        == (placement, calls, micro, mode)
    )


def sync_bound(summary: list[dict[str, Any]], placement: str, calls: int, micro: int) -> float:
    """max(generate, train) + push of the synchronous iterations: each side measured alone, so
    any slow-down that overlapping causes (shared caches, memory bandwidth) counts against it."""
    s = find(summary, placement, calls, micro, "sync")
    return max(s["generate"], s["train"]) + s["push"]


def results_table(summary: list[dict[str, Any]]) -> str:
    headers = [
        "cores (trainer / worker)", "groups/call, micro-batch", "mode", "s/iter", "vs sync",
        "generate", "train", "trainer idle", "worker idle", "push", "ideal", "vs ideal",
        "vs ideal (own spans)", "n",
    ]  # fmt: skip
    rows = []
    for r in summary:
        key = (r["placement"], r["groups_per_call"], r["micro_batch_size"])
        sync = find(summary, *key, "sync")
        bound = sync_bound(summary, *key)
        rows.append(
            [
                "0 / 1 (pinned)" if r["placement"] == "disjoint" else "shared (no pinning)",
                f"{r['groups_per_call']}, {r['micro_batch_size']}",
                r["mode"], r["seconds"], f"{r['seconds'] / sync['seconds']:.2f}x",
                r["generate"], r["train"], r["trainer_idle"], r["worker_idle"], r["push"],
                bound, f"{r['seconds'] / bound:.2f}x", f"{r['vs_ideal']:.2f}x", r["n"],
            ]
        )  # fmt: skip
    return markdown_table(headers, rows)


def verdict(summary: list[dict[str, Any]], placement: str, calls: int, micro: int) -> dict:
    """Whether the overlapped iteration is within 15% of the ideal bound, and where time goes."""
    o = find(summary, placement, calls, micro, "overlap")
    s = find(summary, placement, calls, micro, "sync")
    bound = sync_bound(summary, placement, calls, micro)
    ratio = o["seconds"] / bound
    met = ratio <= 1.15
    text = (
        f"[{placement}, {calls} groups/call, micro-batch {micro}] overlapped "
        f"{o['seconds']:.1f} s/iter vs sync {s['seconds']:.1f} s/iter; ideal "
        f"max(generate, train) + push = {bound:.1f} s from the sync iterations ({ratio:.2f}x), "
        f"{o['ideal']:.1f} s from the overlapped iterations' own spans ({o['vs_ideal']:.2f}x): "
        f"within 15% {'MET' if met else 'NOT met'}. Overlapped, the trainer waits "
        f"{o['first_wait']:.1f} s for its first micro-batch and trains "
        f"{o['train_after_generation']:.1f} s after the last group arrived (optimizer step "
        f"{o['step']:.1f} s included); the push takes {o['push']:.1f} s with neither side "
        "computing."
    )
    return {
        "placement": placement,
        "groups_per_call": calls,
        "micro_batch_size": micro,
        "sync_s": s["seconds"],
        "overlap_s": o["seconds"],
        "ideal_s": bound,
        "overlap_vs_ideal": ratio,
        "ideal_own_spans_s": o["ideal"],
        "overlap_vs_ideal_own_spans": o["vs_ideal"],
        "within_15_percent": met,
        "text": text,
    }


def print_iterations(run: dict[str, Any]) -> None:
    headers = [
        "it", "mode", "calls, mb", "s", "generate", "train", "step", "push", "first wait",
        "train after gen", "ideal", "tokens",
    ]  # fmt: skip
    rows = [
        [
            it["iteration"], ("overlap" if it["overlap"] else "sync")
            + (" (warm-up)" if it["warmup"] else ""),
            f"{it['groups_per_call']}, {it['micro_batch_size']}", it["seconds"],
            it["generate"], it["train"], it["step"], it["push"], it["first_wait"],
            it["train_after_generation"], it["ideal"], it["tokens"],
        ]
        for it in run["iterations"]
    ]  # fmt: skip
    print(markdown_table(headers, rows), flush=True)
