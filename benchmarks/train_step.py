"""The trainer's step on the CPU, with glibc's default malloc vs ``keep_freed_memory``.

What one RL iteration costs the trainer once its rollouts are in: the packed shared-prompt
forward and backward of each micro-batch (``completion_logprobs``, the clipped surrogate, the
DAPO token sum: what ``backward_micro_batch`` runs), the gradient clip and fused AdamW. Each
mode runs in a fresh process on SmolLM2-135M-Instruct in fp32, with the same seeded prompt
groups every step (token ids drawn at random: the cost depends on the lengths, not the tokens),
modes interleaved (A B A B ...). Per step: seconds and minor page faults; the table gives the
medians of the steps after ``--warmup`` and of the first step, and the ratio of the medians.

``default`` leaves malloc as it is; ``keep`` calls
:func:`periodic_rl.cpu_tuning.heap.keep_freed_memory`
first, as the periodic-async strategies do for a CPU trainer.

Default run (the scan's short-prompt workload: 4 groups of 8, prompt 47 tokens, completions of
at most 64 tokens; about 6 minutes on the 2-core machine)::

    .venv/bin/python benchmarks/train_step.py
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import RESULTS_DIR, load_average, machine_info, markdown_table, now_iso, write_json  # noqa: E402

MODES = ("default", "keep")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="prompt groups per iteration")
    p.add_argument("--group-size", type=int, default=8, help="completions per group (G)")
    p.add_argument("--prompt-tokens", type=int, default=47)
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion length cap")
    p.add_argument("--mean-tokens", type=float, default=29.0, help="mean completion length")
    p.add_argument("--micro-batch-groups", type=int, default=1, help="groups per micro-batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--steps", type=int, default=8, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady median")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "train_step.json")
    p.add_argument("--report", type=Path, help="rebuild the table of a result file (no runs)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def workload(config: dict[str, Any]) -> list[tuple[list[int], list[list[int]]]]:
    """The iteration's groups: ``(prompt_ids, [completion_ids, ...])``, seeded."""
    rng = random.Random(0)
    vocab, cap = config["vocab"], config["max_new_tokens"]

    def length() -> int:
        return min(cap, max(1, round(rng.expovariate(1 / config["mean_tokens"]))))

    return [
        (
            [rng.randrange(vocab) for _ in range(config["prompt_tokens"])],
            [[rng.randrange(vocab) for _ in range(length())] for _ in range(config["group_size"])],
        )
        for _ in range(config["groups"])
    ]


def child_main(path: Path) -> None:
    """One run: ``config["mode"]`` applied, then ``steps`` timed trainer steps."""
    config = json.loads(path.read_text())
    from periodic_rl.cpu_tuning.heap import keep_freed_memory

    applied = keep_freed_memory() if config["mode"] == "keep" else False
    import torch

    from periodic_rl.algorithms.losses import loss_numerator, per_token_policy_loss
    from periodic_rl.attention import completion_logprobs, shared_prompt_attention
    from periodic_rl.models import load_causal_lm, resolve_model

    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    policy = load_causal_lm(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    policy.train()
    config["vocab"] = policy.config.vocab_size
    groups = workload(config)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    advantages = torch.randn(config["groups"] * config["group_size"])
    per_micro = config["micro_batch_groups"]
    steps, faults = [], []
    for _ in range(config["steps"]):
        began = time.perf_counter()
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(0, len(groups), per_micro):
            with shared_prompt_attention(policy):
                logps, mask = completion_logprobs(policy, groups[i : i + per_micro])
                rows = slice(i * config["group_size"], (i + per_micro) * config["group_size"])
                per_token, _ = per_token_policy_loss(
                    logps, logps.detach(), advantages[rows], mask, epsilon=0.2, epsilon_high=0.2
                )
                loss_numerator(per_token, mask, "dapo").backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - began)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    tokens = sum(len(p) + sum(len(c) for c in cs) for p, cs in groups)
    config.update(applied=applied, step_s=steps, page_faults=faults, tokens=tokens, ok=True)
    path.write_text(json.dumps(config))


def summarize(runs: list[dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode and r.get("ok")]
        steady = [s for r in mine for s in r["step_s"][warmup:]]
        faults = [f for r in mine for f in r["page_faults"][warmup:]]
        out[mode] = {
            "steady_s": statistics.median(steady) if steady else float("nan"),
            "first_s": statistics.median(r["step_s"][0] for r in mine) if mine else float("nan"),
            "steady_faults": statistics.median(faults) if faults else float("nan"),
            "first_faults": statistics.median(r["page_faults"][0] for r in mine) if mine else 0,
            "peak_rss_gib": statistics.median(r["peak_trainer_rss_gib"] for r in mine)
            if mine
            else float("nan"),
            "runs": len(mine),
        }
    return out


def table(summary: dict[str, dict[str, float]]) -> str:
    base = summary["default"]["steady_s"]
    rows = [
        [
            mode,
            round(s["steady_s"], 2),
            f"{base / s['steady_s']:.2f}x",
            int(s["steady_faults"]),
            round(s["first_s"], 2),
            int(s["first_faults"]),
            s["peak_rss_gib"],
            s["runs"],
        ]
        for mode, s in summary.items()
    ]
    headers = ["malloc", "s/step", "vs default", "page faults/step", "first step s",
               "first step faults", "peak RSS GiB", "runs"]  # fmt: skip
    return markdown_table(headers, rows)


def main() -> None:
    args = parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    if args.report is not None:  # the table again, from the runs
        data = json.loads(args.report.read_text())
        data["summary"] = summarize(data["runs"], data["settings"]["warmup"])
        data["table_markdown"] = table(data["summary"])
        print(data["table_markdown"])
        write_json(args.report, data)
        return
    machine = machine_info()
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}, git {machine['git']}")
    quiet = wait_for_quiet(args.max_load, args.max_wait)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "child", "report")}
    runs = []
    for repeat in range(args.repeats):
        for mode in MODES:
            result = run_child(__file__, {**settings, "config": "train_step", "mode": mode},
                               args.timeout)  # fmt: skip
            steps = [round(s, 2) for s in result.get("step_s", [])]
            print(f"repeat {repeat + 1} {mode}: {steps} s, faults {result.get('page_faults')}")
            runs.append(result)
    summary = summarize(runs, args.warmup)
    markdown = table(summary)
    print(markdown)
    data = {
        "benchmark": "train_step",
        "date": now_iso(),
        "machine": machine,
        "quiet": quiet,
        "settings": settings,
        "runs": runs,
        "summary": summary,
        "table_markdown": markdown,
        "load_at_end": load_average(),
    }
    print(f"\nwrote {write_json(args.output, data)}")


if __name__ == "__main__":
    main()
