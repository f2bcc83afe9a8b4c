"""Write ``docs/gpu.md`` from the JSON of ``benchmarks/gpu_check.py``.

Every line of the page comes from the JSON (what passed, what failed and why, the numbers, the
date, the commit, the device), so the page changes only when a new run does. A JSON of the CPU
mode (``--quick``) is refused unless ``--allow-quick`` is given: the page reports the GPU.

    .venv/bin/python benchmarks/gpu_check_report.py benchmarks/results/gpu_check/gpu_check.json
    .venv/bin/python benchmarks/gpu_check_report.py RESULT.json --output /tmp/gpu.md --allow-quick
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, markdown_table  # noqa: E402 - the benchmarks folder is not a package

MARK = {"passed": "passed", "failed": "**FAILED**", "not-run": "not run"}
INTRO = """\
# The GPU check

`benchmarks/gpu_check.py` checks the CUDA paths on one GPU, without Ray and vLLM (in-process
rollouts, the transformers engine, models built from configs), in at most 8 minutes: training in
bf16 with generation overlapped against the synchronous run, shared-prompt packing against the
padded forward (several model families, fp32 and bf16, backends sdpa, split and FlexAttention,
forward and backward), the numerical probe's half-precision tolerance, DeepSpeed ZeRO-2/3
against one device where DeepSpeed is installed, then a benchmark of packed against padded
forward-backward. To run it on a CUDA machine without network: `make gpu-wheels` here (the
wheels it needs into `.gpu_wheels/`, and the command to run there), then that command, or
`make gpu-check` there. This page is generated from its JSON by
`benchmarks/gpu_check_report.py`; [shared_prompt.md](shared_prompt.md) explains the packing,
[scaling.md](scaling.md) the GPU set-ups.
"""


def sci(value: Any) -> str:
    """Small numbers as ``1.2e-05``; None as an empty cell."""
    if value is None:
        return ""
    return f"{value:.1e}" if isinstance(value, float) else str(value)


def note(row: dict[str, Any], limit: int) -> str:
    """The error or the reason of ``row``, on one line and safe inside a table cell."""
    text = row.get("error") or row.get("reason") or ""
    return " ".join(text.split()).replace("|", "\\|")[:limit]


def summary(result: dict[str, Any]) -> str:
    env = result["environment"]
    counts = result["counts"]
    device = env.get("device_name", env["device"])
    memory = f", {env['device_memory_gib']} GiB" if "device_memory_gib" in env else ""
    lines = [
        f"Run {result['date']} on {device}{memory} ({env['device']}), commit "
        f"`{result.get('commit') or 'unknown'}`: Python {env['python']}, torch {env['torch']} "
        f"(CUDA {env['cuda']}), transformers {env['transformers']}, lightning "
        f"{env['lightning']}; {result['seconds']} s of a {result['budget_s']:.0f} s budget"
        + (", **quick mode (tiny shapes)**" if result.get("quick") else "")
        + ("" if result.get("finished", True) else ", **stopped before its last check**")
        + ".",
        "",
        f"**{counts['passed']} passed, {counts['failed']} failed, {counts['not-run']} not run.**",
        "",
    ]
    rows = []
    for check in result["checks"]:
        rows.append([check["name"], check["what"], MARK[check["status"]], check.get("seconds", ""),
                     note(check, 200)])  # fmt: skip
    lines.append(markdown_table(["check", "what", "result", "seconds", "error / reason"], rows))
    return "\n".join(lines)


def overlap_section(numbers: dict[str, Any]) -> str:
    return (
        f"{numbers['iterations']} iterations in {numbers['precision']} on {numbers['device']}: "
        f"largest parameter difference {sci(numbers['max_param_diff'])} between the overlapped "
        f"and the synchronous run, against an update of {sci(numbers['max_update'])} "
        f"(tolerance {numbers['tolerance']}); identical completions: "
        f"{'yes' if numbers['same_completions'] else 'no'}; overlap (synchronous, streamed): "
        f"{numbers.get('overlapped')}."
        + (
            f" The longer runs first sampled differently at iteration {numbers['diverged_at']} "
            "(bf16 rounding of the earlier updates); the iterations before it were compared."
            if numbers.get("diverged_at") and numbers["diverged_at"] == numbers["iterations"]
            else ""
        )
    )


def packing_section(numbers: dict[str, Any]) -> str:
    rows = [
        [
            c["family"],
            c["dtype"],
            c["backend"],
            MARK.get(c.get("forward_status", "not-run")),
            sci(c.get("forward_logp_diff")),
            sci(c.get("forward_padded_logp_diff")),
            MARK.get(c.get("backward_status", "not-run")),
            sci(c.get("backward_grad_rel_diff")),
            sci(c.get("backward_padded_grad_rel_diff")),
            note(c, 120),
        ]
        for c in numbers["cases"]
    ]
    headers = ["family", "dtype", "backend", "forward", "log-prob diff", "padded's",
               "backward", "grad diff (rel.)", "padded's", "note"]  # fmt: skip
    return (
        "Packed against padded: fp32 within 1e-4 (log-probs) and 1e-3 (gradients, relative); "
        "bf16 against the padded forward in fp32 on the same rounded weights, at most twice the "
        "padded bf16 path's own error plus 5e-3 (the padded columns).\n\n"
        + markdown_table(headers, rows)
    )


def probe_section(numbers: dict[str, Any]) -> str:
    rows = [
        [
            c["family"],
            c["dtype"],
            c.get("tolerance", ""),
            "yes" if c.get("accepted") else "no",
            sci(c.get("exact_mean")),
            sci(c.get("exact_max")),
            "yes" if c.get("refused_broken") else "no",
            sci(c.get("broken_distance", c.get("broken_mean"))),
        ]
        for c in numbers["cases"]
    ]
    headers = ["family", "dtype", "tolerance", "exact accepted", "its mean diff", "its max diff",
               "broken refused", "broken's distance"]  # fmt: skip
    return (
        "The probe must accept the exact packed path and refuse one whose decoder drops "
        "`position_ids`.\n\n" + markdown_table(headers, rows)
    )


def deepspeed_section(numbers: dict[str, Any]) -> str:
    rows = [
        [stage, MARK[v["status"]], sci(v.get("max_param_diff")), note(v, 120)]
        for stage, v in numbers.items()
    ]
    return markdown_table(["stage", "result", "largest parameter diff", "reason"], rows)


def benchmark_section(numbers: dict[str, Any]) -> str:
    rows = []
    by_shape: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in numbers["rows"]:
        by_shape.setdefault((r["prompt"], r["G"]), {})[r["layout"]] = r
    for (prompt, g), layouts in by_shape.items():
        for layout, r in layouts.items():
            speed = r.get("tokens_per_s")
            padded = layouts.get("padded", {}).get("tokens_per_s")
            ratio = f"{speed / padded:.2f}x" if speed and padded and layout == "packed" else ""
            memory = r.get("peak_memory_gib")
            rows.append([prompt, g, r["reply"], layout, MARK[r["status"]],
                         f"{speed:.0f}" if speed else "", ratio,
                         f"{memory:.2f}" if memory is not None else "",
                         note(r, 80)])  # fmt: skip
    headers = ["prompt", "G", "reply", "layout", "result", "tokens/s", "vs padded",
               "peak GiB", "note"]  # fmt: skip
    return (
        f"One group's forward-backward, {numbers['parameters'] / 1e9:.2f}B parameters in "
        f"{numbers['dtype']} (backend {numbers['backend']}); completion tokens per second (the "
        "best of the timed repeats) and `torch.cuda.max_memory_allocated`.\n\n"
        + markdown_table(headers, rows)
    )


SECTIONS = {
    "overlap": ("Overlapped == synchronous training", overlap_section),
    "packing": ("Shared-prompt packing", packing_section),
    "probe": ("The numerical probe", probe_section),
    "deepspeed": ("DeepSpeed ZeRO-2/3", deepspeed_section),
    "benchmark": ("Packed against padded forward-backward", benchmark_section),
}


def page(result: dict[str, Any]) -> str:
    parts = [INTRO, "## The last run\n", summary(result)]
    for check in result["checks"]:
        title, section = SECTIONS[check["name"]]
        parts.append(f"\n## {title}\n")
        if "numbers" in check:
            parts.append(section(check["numbers"]))
        else:
            what = "Failed" if check["status"] == "failed" else "Not run"
            parts.append(f"{what}: {note(check, 2000)}.")
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="gpu_check.json")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "gpu.md")
    parser.add_argument("--allow-quick", action="store_true", help="accept a --quick run's JSON")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    if result.get("quick") and not args.allow_quick:
        parser.error(
            f"{args.result} is from a --quick run (tiny shapes): the page reports the GPU run; "
            "pass --allow-quick (with another --output) to render it anyway"
        )
    args.output.write_text(page(result))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
