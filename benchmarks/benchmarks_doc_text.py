"""The prose of ``docs/benchmarks.md``: what each configuration is, and the page's templates.

``benchmarks_doc.fill`` fills the ``{name}`` fields from the result files; a sentence whose
numbers a file lacks is left out. Kept apart from the code that computes the numbers.
"""

WHAT = {  # what each letter means (the JSON holds only the short labels)
    "a": "TRL `GRPOTrainer` ({trl}), its default generation (transformers `generate`), "
    "`use_cpu=True`",
    "b": 'TRL `GRPOTrainer`, `use_vllm=True, vllm_mode="colocate"`',
    "c": "periodic_rl `PeriodicAsyncStrategy(overlap=False)`, one vLLM worker, "
    "`shared_prompt=False`",
    "c2": "(c') as c, with `shared_prompt=True`: packing without overlap",
    "d": "periodic_rl `overlap=True`, `shared_prompt=True`, one-group micro-batches (the "
    "library default), `CPUTuning(trainer_cores=[0], worker_cores=[[1]], "
    "lend_idle_cores=False)` (each side on its own core throughout)",
    "dl": "as d, with `CPUTuning(lend_idle_cores=True)` (the library's default from 2026-12-04 "
    "on): once "
    "the worker has generated the iteration, the "
    "trainer also runs on core 1 (its last micro-batches, the optimizer step) until the push",
    "e": 'periodic_rl `CPUTuning(worker_cores="auto", split_after=1)`, c2\'s micro-batch '
    "size: it starts "
    "taking turns on both cores (c2's split) and, after one measured iteration, moves to overlap "
    "(trainer core 0, worker core 1; the worker moves in place) only if its model predicts that "
    "faster, then keeps the faster of the two; the choice is cached (a fresh cache per "
    "invocation: the first e run measures, the later ones start on its choice)",
}
CORES = {  # how each configuration uses the machine's cores
    "a": "torch on all cores",
    "c": "the trainer on all cores, then the vLLM worker pinned to all cores (they take turns)",
    "c2": "as c",
    "d": "one core each (trainer 0, worker 1), at the same time",
    "dl": "as d, and both to the trainer from the end of each iteration's generation to the push",
    "e": "chosen by `auto` in each run: one core each at the same time, or all in turn",
}
SHORT = """\
**The short version.** On the {nproc}-core {device_name} machine, `{model}`, {P} prompts x {G}
completions x at most {R} new tokens per step, {seeds_n}:

- The fastest periodic_rl configuration, ({best}), makes **{best_x}** as many completions per
  second as TRL's default path (a) (median step; {best_x_mean} from total time). The 3x
  target is {met} at this workload.
- No comparison with TRL: (a) or every periodic_rl configuration is missing.{no_best}
- Overlapped (d) against synchronous (c2): {d_x} the speed, **{d_verdict}** (median s/step
  {d_s} against {c2_s}).
- Overlapped (e) against synchronous (c2): {e_x} the speed, **{e_verdict}** (median s/step
  {e_s} against {c2_s}).
- The trainer borrowing the idle worker core (dl) against not (d): {dl_vs_d} the speed
  (median s/step {dl_s} against {d_s}).
- What `worker_cores: auto` (e) settled on in each run: {e_choices}.
- Rewards, the mean over the steps: {reward}.
- With `--precision {bf16_precision} --engine-dtype {bf16_vllm_dtype}`{bf16_stale}:
  ({bf16_best}) makes {bf16_best_x} the completions/s of (a) ({bf16_best_x_mean} from total
  time); {bf16_dtype}.
- Workload scan{scan_stale}, (a)'s s/step over periodic_rl's, and `auto` (e) against the
  synchronous run (c2): {scan_points}.
- {b}"""
RUN = """\
## What was run

{commands}

`python` is `.venv/bin/python`. Each configuration runs in its own fresh interpreter. Runs are
interleaved, in this order: {order}. {repeats_n}, {steps} optimizer steps each; repeat r samples
with seed r on both sides (the prompts and initial weights are the same in every run). The first
{warm} of every run is warm-up and is not counted.

{config_table}

**Held equal in every configuration:**

- the model: `{model}` (`resolve_model`);
- the prompts of every step: rows 0-{last_row} of `builtin:arithmetic`'s train split, in order,
  {P} per step, chat-templated by the same tokenizer; the script checks that all configurations
  see the same prompt token ids, and they {prompt_same};
- the rewards: {reward_fn}. TRL gets thin wrappers that take the text out of its message-list
  completions;
- the sampling: G = {G}, `max_new_tokens` {R}, temperature {temperature}, top-p {top_p};
- the loss: `loss_type="{loss_type}"`, `beta={beta}` (no reference model), epsilon {epsilon},
  {scale_rewards}-scaled advantages;
- the optimizer: {optimizer} at a {lr_schedule} learning rate of {lr} (TRL:
  `lr_scheduler_type="{lr_schedule}"`), gradient clip {max_grad_norm};
- one optimizer step per {completions_per_step} completions. TRL:
  `per_device_train_batch_size={micro_batch_size}` x
  `gradient_accumulation_steps={gradient_accumulation_steps}`; periodic_rl c, c2:
  `micro_batch_size={micro_batch_size}`; d, e: the library default, one group ({G}): the split
  changes, the update does not (`tests/test_training_invariants.py`);
- precision `{precision}` over {dtype} weights (periodic_rl's vLLM: `{vllm_dtype}`), gradient
  checkpointing {checkpointing} on both sides;
- all of the machine's cores, in every configuration: {cores}.

periodic_rl runs use `num_val=0` (no held-out evaluation), no progress bar and no logger.

**What is measured:**

- **s/step**: the median over the measured steps of all repeats pooled ({pooled} steps). A step
  runs from the end of the previous step to its own end, so it includes everything the framework
  does between steps.
- **s/step (mean)**: total time over total steps.
- **completions/s** and **tokens/s**: per median step.
- **start-up**: from process start to the first step. This covers imports, model load, Ray and
  engine start, and the first weight push.
- **peak memory**: sampled every 0.5 s over the whole process tree: the trainer, Ray's processes
  and the vLLM actor. PSS counts shared pages once.
- **generate / train / weight push**: periodic_rl takes these from its own timing spans. For TRL,
  `generate` wraps `_generate_single_turn` and `train` is the rest of the step: forward and
  backward, the optimizer, rewards and logging.
- **overlapped vs synchronous** (the verdicts): each measured step of an overlapped
  configuration is paired with the synchronous run's (c2) step of the same seed and index (the
  same prompts and, as the reward tables show, the same update). The verdict is **SLOWER** when
  a 90% bootstrap interval of the median pair ratio lies wholly below 1, **not slower** when the
  ratio of median steps is at least 1, and **within noise** otherwise: a run that takes turns
  on the same cores as c2 (what `auto` keeps unless overlap is predicted faster) differs from
  c2 by that much from run to run.

## The machine

- {nproc} x {cpu}{flags}, {memory_gib} GiB, device `{device}`.
- {platform}, Python {python}.
- {versions}.
- Git commit {commit} (git dirty: {dirty}); finished {date}.
- Load average (1 min) {load_before} before the first run (it waited {waited} s for at most
  {max_load}), {load_after} after the last; the runs started at {loads}. Each run's load at its
  start and end is in the JSON."""
WHERE = """\
Measured on {nproc} x {cpu} at commit {commit} (git dirty: {dirty}), {date}.

**Stale: this file is not from the main table's code and machine** (that was commit
{main_commit} on {main_cpu}). It measured other code or another machine: compare its numbers
with the main table's only with care, and rerun it to refresh them.{stale}"""
RESULT = """\
## {title} (`{model}`, {P} prompts x G {G}, <= {R} tokens, {steps} steps, {repeats_n})

`{file}`, re-tabulated from its runs.

{where}

{table}

periodic_rl's {dtype_used}.

### Reward per optimizer step (speed at matched learning)

Mean over the {seeds_n}, [min, max] over seeds:

{reward_table}

- **{same_traj} have identical trajectories for each seed**: packing and overlap change nothing
  about what is learnt{differ}.
- Mean reward over the steps: {reward}.
- TRL's and periodic_rl's samplers draw different samples from the same weights, so equal seeds
  do not give equal trajectories across frameworks.{if_best}

### Where a measured step goes (medians over the measured steps, seconds)

{breakdown}

- **Generation**: TRL's `generate` (a) {a_gen} s a step; vLLM on all cores (c2) {c2_gen} s.
- **Packing**: training fell from {c_train} s (padded, c) to {c2_train} s (packed,
  c2){trl_train}.
- **Overlap (d)**: generation on one core {d_gen} s, training on the other {d_train} s; the best
  overlap, the longer of the two plus the push, is {d_bound} s against c2's {c2_s} s; measured
  {d_s} s (pipeline fill and drain).
- **Weight push**: {push} s a step (TRL's default path has none).
- **Start-up**: {startup} s{trl_startup} (Ray, the vLLM actor, the first push); not in the
  per-step numbers.
- **Memory**: periodic_rl's process tree peaks at {pss} GiB PSS, its trainer alone at
  {trainer_rss} GiB RSS{trl_pss}.

**Verdict** (`vs_trl_report.target_verdict`):

{verdict}"""
SCAN = """\
## Workload scan: where packing and overlap contribute

`{command}`, `{file}`.

{where}

- `{model}`, {steps} steps ({warmup_steps} warm-up), {repeats_n}, micro-batches of {micro}.
- Longer prompts come from a system prompt of filler instructions (`--system-words`{words}).
- The padded run (c) was not in this scan, so "packing" shows "-".{no_c}

{scan_table}

Breakdown (medians over the {measured_steps} measured steps, seconds):

{breakdowns}

Verdicts per workload (`vs_trl_report.target_verdict`):

{verdicts}"""
CAVEATS = """\
## Caveats

- **{nproc} cores.** The overlap design assumes the rollout side and the trainer each have
  hardware of their own. Here that is a share of {nproc} CPU cores, and both workloads scale with
  cores, so splitting can lose. The result says nothing about one GPU per side, or many cores.
- **A shared machine.** Nothing enforces quiet beyond the start-up load check (`--max-load`);
  interleaving and medians blunt interference.
- **Each run on a settled machine.** Before each run the harness waited until the CPU stayed at
  most 20% busy for 3 s (here {settle} s), and after it, for what the run left running in its
  session to exit ({leftovers}); each repeat starts one configuration later, so that no
  configuration always follows the same one.
- **Short runs.** {measured_steps} measured steps per run, {repeats_n}{scan_repeats}.
- **{seeds_n}.** The reward comparison shows whether both learn at a similar rate, no more.
- **Small workload.** At {P} x {G} completions of at most {R} tokens, fixed costs dominate:
  vLLM's per-decode-step overhead, the weight push ({push} s a step), and Ray start-up.
- **vLLM on the CPU runs eager.** Compiled mode decodes faster but takes minutes to start.
- **TRL with vLLM.** {b}
- **Not tuned.** Neither side was tuned beyond matching the settings: periodic_rl uses its
  defaults, TRL its defaults except for what had to match (constant learning rate, no gradient
  checkpointing, precision `{precision}`, `shuffle_dataset=False`).
- **The allocator.** periodic_rl's CPU trainer keeps the memory it frees for its next
  allocations (`periodic_rl.cpu_tuning.heap.keep_freed_memory`, 1.13x per training step in
  `benchmarks/train_step.py`); TRL's process runs with glibc's defaults, as a TRL user's would.
  With the same setting TRL is faster too: `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647
  python benchmarks/vs_trl.py --configs a --repeats 1 --steps 8 --trl-vllm-repeats 0`, run once
  by hand after the same command without the variables (commit 01115c9, seed 0): 19.5 s per
  step against 20.8 (1.07x; training 13.8 s against 15.4). Not part of the tables above.
- `--quick` (a tiny random model) is a smoke test of the script; its numbers are not reported.
  This page covers the CPU result files; `bash benchmarks/gpu.sh` runs the comparison on one
  CUDA GPU."""
