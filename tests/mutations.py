"""Mutation checks: each promise of the library, broken on purpose, must fail a test.

``make mutations`` (or ``.venv/bin/python tests/mutations.py [NAME ...]``) runs, for each row of
:data:`MUTATIONS`: copy the repository's tracked ``src/``, ``tests/``, ``examples/``,
``pyproject.toml`` and ``benchmarks/soak_run.py`` (which ``tests/test_soak.py`` imports) to a
temporary directory, apply one exact text replacement to one file (the
original text must occur exactly once, so a refactor cannot silently disable a mutation), and
run only the tests that should catch it, with ``PYTHONPATH`` pointing at the copy's ``src`` (the
child checks that ``periodic_rl`` is imported from there, not from the editable install, and so
do the Ray workers, which import from the same directory). A mutation is *caught* when those
tests fail. Before the mutations, the same tests run once on an unmutated copy and must pass,
else a "caught" would mean nothing. Exit status 0 only if every mutation was caught.

Not collected by pytest (no ``test_`` prefix). To add a mutation, append a :class:`Mutation`:
``old`` is copied verbatim from the file (whitespace included), ``tests`` are pytest node ids
relative to the repository root.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = [
    "src",
    "tests",
    "examples",
    "pyproject.toml",
    "benchmarks/soak_run.py",  # the soak test imports it, and its helpers
    "benchmarks/common.py",
    "benchmarks/vs_trl_report.py",  # the benchmark's verdicts, and what they import
    "benchmarks/vs_trl_runs.py",
]
TIMEOUT_S = 1200


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


STRATEGY_TESTS = "tests/strategies/test_periodic_async.py"
DISTRIBUTED_TESTS = "tests/strategies/test_distributed.py"
STALENESS_TESTS = "tests/strategies/test_staleness.py"

MUTATIONS: list[Mutation] = [
    Mutation(
        name="overlap switched off (the producer always joined first)",
        file="src/periodic_rl/rollout/controller.py",
        old=(
            "            if not self.options.overlap:\n"
            '                with self.spans.span("wait", "trainer"):\n'
            "                    thread.join()"
        ),
        new='            if True:\n                with self.spans.span("wait", "trainer"):\n'
        "                    thread.join()",
        tests=(f"{STRATEGY_TESTS}::test_training_starts_before_the_last_group_is_generated",),
    ),
    Mutation(
        name="on-policy check compares the version only",
        file="src/periodic_rl/on_policy.py",
        old="        if not 0 <= staleness <= max_staleness or group.fingerprint != expected:\n",
        new="        if not 0 <= staleness <= max_staleness:\n",
        tests=(
            f"{STRATEGY_TESTS}::test_rollout_from_other_weights_of_the_current_version_is_refused",
        ),
    ),
    Mutation(
        name="a killed worker's lost calls are not sent again",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old=(
            "                    pending.appendleft(call.jobs)"
            "  # same jobs, same seeds, another try\n"
            "                    self.redispatched_calls += 1\n"
        ),
        new="",
        tests=(
            "tests/rollout/test_ray_rollouts.py::"
            "test_worker_killed_mid_iteration_loses_and_repeats_nothing",
            f"{STRATEGY_TESTS}::test_worker_killed_mid_iteration_gives_the_fault_free_update",
        ),
    ),
    Mutation(
        name="a dead worker is replaced only at the next push",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old=(
            "                    self.redispatched_calls += 1\n"
            "                    self._restart(slot, call.incarnation, error)\n"
        ),
        new=(
            "                    self.redispatched_calls += 1\n"
            "                    slot.in_flight = self.max_calls_in_flight  # parked until a push\n"
        ),
        tests=(
            "tests/rollout/test_ray_rollouts.py::"
            "test_worker_killed_mid_iteration_loses_and_repeats_nothing",
            f"{STRATEGY_TESTS}::test_worker_killed_mid_iteration_gives_the_fault_free_update",
        ),
    ),
    Mutation(
        name="HFEngine fingerprints what it received, not what it holds",
        file="src/periodic_rl/rollout/hf_engine.py",
        old="loaded_fingerprint(state_dict, {n: held[n] for n in state_dict if n in held})",
        new="weights_fingerprint(state_dict)",
        tests=("tests/rollout/test_engine_fingerprints.py",),
    ),
    Mutation(
        name="vLLM worker fingerprints what it received, not what its loader took in",
        file="src/periodic_rl/rollout/vllm_worker.py",
        old="    return loaded_fingerprint(received, held)\n",
        new=(
            "    from periodic_rl.weight_sync.fingerprint import weights_fingerprint\n\n"
            "    return weights_fingerprint(received)\n"
        ),
        tests=("tests/rollout/test_engine_fingerprints.py",),
    ),
    Mutation(
        name="training ignores the sampling temperature",
        file="src/periodic_rl/micro_batch.py",
        old=(
            "        temperature=h.temperature,"
            "  # train on the distribution the rollouts sampled from\n"
        ),
        new="",
        tests=("tests/test_temperature.py",),
    ),
    Mutation(
        name="cli.main returns the CLI object (the console script exits 1)",
        file="src/periodic_rl/cli.py",
        old="    PeriodicRLCLI(\n        RLModule,\n",
        new="    return PeriodicRLCLI(\n        RLModule,\n",
        tests=("tests/test_cli.py::test_installed_script_trains_and_exits_zero",),
    ),
    Mutation(
        name="KL penalty dropped from the loss",
        file="src/periodic_rl/micro_batch.py",
        old="            beta=h.beta,\n",
        new="            beta=0.0,\n",
        tests=("tests/test_module_training.py",),
    ),
    Mutation(
        name="shared-prompt numerical probe switched off",
        file="src/periodic_rl/attention/support.py",
        old="    if _PROBING.get():\n        return\n",
        new="    if True:\n        return\n",
        tests=("tests/attention/test_families.py::test_family_is_exact_or_refused[roberta]",),
    ),
    Mutation(
        name="models outside transformers' AttentionInterface not refused",
        file="src/periodic_rl/attention/integration.py",
        old="    if not uses_attention_interface(type(base)):",
        new="    if False:",
        tests=("tests/attention/test_families.py::test_family_is_exact_or_refused[gptj]",),
    ),
    Mutation(
        name="non-attention layers (recurrent, conv) not refused",
        file="src/periodic_rl/attention/integration.py",
        old="    other = set(_layer_kinds(text)) - ATTENTION_LAYER_TYPES",
        new="    other = set()",
        tests=("tests/attention/test_families.py::test_family_is_exact_or_refused[qwen3_next]",),
    ),
    Mutation(
        name="micro_batch_size read from the parsed hparams (None from the CLI)",
        file="src/periodic_rl/module.py",
        old="            micro_batch_size=self.micro_batch_size,",
        new="            micro_batch_size=self.hparams.micro_batch_size,",
        tests=("tests/test_cli.py::test_minimal_yaml_trains",),
    ),
    Mutation(
        name="held-out metrics not logged through self.log",
        file="src/periodic_rl/evaluation.py",
        old='            module.log(\n                f"eval/{name}",',
        new='            if False: module.log(\n                f"eval/{name}",',
        tests=("tests/test_evaluation.py::test_start_periodic_and_end_evaluations",),
    ),
    Mutation(
        name="learning-rate scheduler never stepped",
        file="src/periodic_rl/module.py",
        old="        optim.step_schedulers(self)  #",
        new="        pass  #",
        tests=("tests/test_optimizers.py::test_warmup_then_cosine",),
    ),
    Mutation(
        name="several devices silently trained on one",
        file="src/periodic_rl/strategies/periodic_async.py",
        old="        if devices and len(devices) > 1:",
        new="        if False:",
        tests=(
            "tests/strategies/test_devices.py::test_several_devices_are_refused_naming_the_fix",
        ),
    ),
    Mutation(
        name="strategy device ignores the accelerator",
        file="src/periodic_rl/strategies/periodic_async.py",
        old="        if self._parallel_devices:\n            return self._parallel_devices[0]\n",
        new="",
        tests=("tests/strategies/test_devices.py::test_follows_the_gpu_accelerator",),
    ),
    Mutation(
        name="a failing training step does not stop the iteration's generation",
        file="src/periodic_rl/module.py",
        old="        with closing(micro_batches):",
        new="        if True:",
        tests=("tests/test_module.py::test_failing_training_step_stops_the_iteration_generation",),
    ),
    Mutation(
        name="a cancelled stream still accepts groups",
        file="src/periodic_rl/rollout/stream.py",
        old="            if self._cancelled.is_set():\n                return False\n",
        new="",
        tests=(
            "tests/rollout/test_stream.py::test_cancel_drops_queued_groups_and_ignores_later_ones",
        ),
    ),
    Mutation(
        name="held-out rows carved from a file stay in training",
        file="src/periodic_rl/data/sources.py",
        old="    train = [row for row, key in zip(rows, keys, strict=True) if key not in held]",
        new="    train = list(rows)",
        tests=("tests/data/test_sources.py::test_single_jsonl_file_is_carved_disjoint",),
    ),
    Mutation(
        name="reward model inputs not moved to its device",
        file="src/periodic_rl/rewards.py",
        old="            ).to(self.device)",
        new="            )",
        tests=("tests/test_rewards.py",),
    ),
    Mutation(
        name="in-process rollouts trust the engine's fingerprint unchecked",
        file="src/periodic_rl/rollout/local.py",
        old="        if fingerprint != expected:\n",
        new="        if False:\n",
        tests=("tests/rollout/test_local.py",),
    ),
    Mutation(
        name="transformers' mask functions never found (ordinary forwards left unmasked)",
        file="src/periodic_rl/compat/transformers.py",
        old="    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:\n",
        new="    if True:\n",
        tests=(
            "tests/compat/test_transformers.py::"
            "test_registered_mask_function_is_the_one_transformers_builds_masks_with",
        ),
    ),
    Mutation(
        name="loss normaliser counts not summed over ranks",
        file="src/periodic_rl/module.py",
        old='            int(c) for c in self.trainer.strategy.reduce(counts, reduce_op="sum")\n',
        new="            int(c) for c in counts\n",
        tests=(f"{DISTRIBUTED_TESTS}::test_two_ddp_ranks_equal_one_rank[full-overlap]",),
    ),
    Mutation(
        name="every rank draws the same prompts",
        file="src/periodic_rl/data/loader.py",
        old="        start = (position * self.world_size + self.rank) * self.batch_size\n",
        new="        start = position * self.world_size * self.batch_size\n",
        tests=(
            "tests/data/test_loader.py",
            f"{DISTRIBUTED_TESTS}::test_two_ddp_ranks_equal_one_rank[full-overlap]",
        ),
    ),
    Mutation(
        name="only rank 0 checks its groups against the pushed weights",
        file="src/periodic_rl/module.py",
        old="        check_on_policy(groups, strategy.policy_version,",
        new="        self.global_rank == 0 and check_on_policy(groups, strategy.policy_version,",
        tests=(f"{DISTRIBUTED_TESTS}::test_every_rank_refuses_a_stale_group",),
    ),
    Mutation(
        name="FSDP push without gathering the shards",
        file="src/periodic_rl/strategies/distributed.py",
        old="fsdp2_full_tensor, self.global_rank)\n",
        new="None, self.global_rank)\n",
        tests=(f"{DISTRIBUTED_TESTS}::test_two_fsdp_ranks_equal_one_rank",),
    ),
    Mutation(
        name="truncated completions not masked out of the loss",
        file="src/periodic_rl/truncation.py",
        old="    return mask * keep.unsqueeze(1)\n",
        new="    return mask\n",
        tests=(
            "tests/test_truncation_training.py::"
            "test_masked_truncated_completions_contribute_nothing[dapo]",
        ),
    ),
    Mutation(
        name="TIS weights not truncated at tis_cap",
        file="src/periodic_rl/algorithms/losses.py",
        old="    return torch.where(valid, torch.exp(delta).clamp(max=cap), zeros)\n",
        new="    return torch.where(valid, torch.exp(delta), zeros)\n",
        tests=(
            "tests/algorithms/test_losses.py::test_tis_weights_and_loss_written_out",
            "tests/test_mismatch.py::test_tis_weights_are_capped",
        ),
    ),
    Mutation(
        name="bounded staleness: the schedule lags 2k versions instead of k",
        file="src/periodic_rl/rollout/pipeline.py",
        old="        return max(self.first, iteration - self.max_staleness)\n",
        new="        return max(self.first, iteration - 2 * self.max_staleness)\n",
        tests=(
            "tests/rollout/test_pipeline.py::test_iterations_run_ahead_on_the_fixed_schedule",
            f"{STALENESS_TESTS}::test_k1_overlapped_equals_synchronous_on_the_fixed_schedule",
        ),
    ),
    Mutation(
        name="bounded staleness: stale rollouts trained without importance correction",
        file="src/periodic_rl/algorithms/mismatch.py",
        old="    if tis_cap is None and max_staleness > 0:\n",
        new="    if False:\n",
        tests=(
            f"{STALENESS_TESTS}::test_stale_update_is_the_importance_corrected_gradient_written_out",
        ),
    ),
    Mutation(
        name="bounded staleness: groups older than k accepted",
        file="src/periodic_rl/on_policy.py",
        old="        if not 0 <= staleness <= max_staleness or group.fingerprint != expected:\n",
        new="        if not 0 <= staleness or group.fingerprint != expected:\n",
        tests=("tests/test_on_policy.py",),
    ),
    Mutation(
        name="bounded staleness: the checkpoint keeps no older weights",
        file="src/periodic_rl/rollout/controller.py",
        old="        if self.pipeline is None or self.link.rank != 0:\n            return {}\n",
        new="        if True:\n            return {}\n",
        tests=("tests/test_checkpoint.py::test_bounded_staleness_resumes_its_schedule_exactly",),
    ),
    Mutation(
        name="dynamic sampling keeps zero-variance groups",
        file="src/periodic_rl/rollout/dynamic_sampling.py",
        old="    return not group.rewards or max(group.rewards) == min(group.rewards)\n",
        new="    return False\n",
        tests=("tests/test_dynamic_sampling_training.py",),
    ),
    Mutation(
        name="num_iterations: later updates take the current log-probs as the old policy",
        file="src/periodic_rl/micro_batch.py",
        old="            first.old_logps,\n",
        new="            logps.detach(),\n",
        tests=(
            "tests/test_num_iterations.py::test_two_updates_equal_the_written_out_two_epoch_computation",
        ),
    ),
    Mutation(
        name="num_iterations: every inner step pushes the weights",
        file="src/periodic_rl/module.py",
        old="        with nullcontext() if push else strategy.pushes_deferred():\n",
        new="        with nullcontext():\n",
        tests=(
            "tests/test_num_iterations.py::test_two_updates_equal_the_written_out_two_epoch_computation",
        ),
    ),
    Mutation(
        name="a local Ray started on the machine's routable address (not loopback)",
        file="src/periodic_rl/rollout/placement.py",
        old="    with all_cores(), gpus, loopback_node() if loopback else nullcontext():\n",
        new="    with all_cores(), gpus, nullcontext():\n",
        tests=("tests/rollout/test_network.py::test_a_local_run_listens_on_loopback_only[hf]",),
    ),
    Mutation(
        name="rendezvous store on every interface (torch's own env:// store)",
        file="src/periodic_rl/compat/torch_distributed.py",
        old='        kwargs["store"] = _store(',
        new="        _ = (",
        tests=("tests/compat/test_torch_distributed.py",),
    ),
    Mutation(
        name="sandbox without a PID namespace (a daemonized child outlives the run)",
        file="src/periodic_rl/_sandbox_child.py",
        old="libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)",
        new="libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)",
        tests=("tests/test_sandbox.py::test_forked_children_and_daemons_do_not_survive_the_run",),
    ),
    Mutation(
        name="sandbox without a network namespace",
        file="src/periodic_rl/_sandbox_child.py",
        old="libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)",
        new="libc.unshare(CLONE_NEWUSER | CLONE_NEWPID)",
        tests=("tests/test_sandbox.py::test_no_connection_leaves_the_sandbox[namespaces]",),
    ),
    Mutation(
        name="soak: a run's own local Ray is left running after the fit",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old="                ray.shutdown()\n                self._owns_ray = False\n",
        new="                self._owns_ray = False\n",
        tests=("tests/test_soak.py",),
    ),
    Mutation(
        name="bad input: rows with a missing column are not refused",
        file="src/periodic_rl/data/checks.py",
        old="        if columns != first:\n",
        new="        if False:\n",
        tests=(
            "tests/data/test_bad_rows.py::"
            "test_column_missing_from_some_rows_names_the_row_and_the_column",
        ),
    ),
    Mutation(
        name="bad input: the prompt-length check forgets max_new_tokens",
        file="src/periodic_rl/rollout/engine_checks.py",
        old="            if length + max_new_tokens > max_len:\n",
        new="            if length > max_len:\n",
        tests=(
            "tests/rollout/test_engine_checks.py::"
            "test_prompt_longer_than_max_model_len_names_the_row_and_the_fixes",
        ),
    ),
    Mutation(
        name="bad input: the KV-cache check ignores the group's size",
        file="src/periodic_rl/rollout/engine_checks.py",
        old="    blocks = max(num_generations * _blocks(",
        new="    blocks = max(0 * _blocks(",
        tests=(
            "tests/rollout/test_engine_checks.py::"
            "test_kv_cache_too_small_for_one_group_names_kv_cache_gb_and_the_minimum",
        ),
    ),
    Mutation(
        name="reward failures: the per-call timeout not applied",
        file="src/periodic_rl/rewards.py",
        old="    if timeout_s is None:\n        return func(prompts, completions, **columns)\n",
        new="    if True:\n        return func(prompts, completions, **columns)\n",
        tests=(
            "tests/test_scoring.py::"
            "test_a_call_that_never_returns_raises_a_timeout_naming_reward_and_limit",
            "tests/test_scoring.py::test_zero_counts_a_call_that_never_returns",
        ),
    ),
    Mutation(
        name="reward failures: reward_on_error zero does not count the failing call",
        file="src/periodic_rl/scoring.py",
        old="            if count:\n                self._failures[name] += 1\n",
        new="",
        tests=(
            "tests/test_scoring.py::"
            "test_training_run_with_a_failing_reward_finishes_and_logs_the_exact_count",
        ),
    ),
    Mutation(
        name="faults: a hung rollout call is never timed out",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old=(
            "                for slot, waited in hung_slots(self._slots, in_flight, "
            "self.call_timeout_s):\n"
            '                    self._restart_hung(slot, waited, "call")'
            "  # its calls come back failed\n"
        ),
        new="",
        tests=(
            "tests/rollout/test_faults.py::test_hung_worker_is_killed_and_its_calls_sent_again",
        ),
    ),
    Mutation(
        name="faults: a full disk is not recognised through torch.save's writer",
        file="src/periodic_rl/checkpoint.py",
        old="                torch.save(checkpoint, writer)\n",
        new="                torch.save(checkpoint, handle)\n",
        tests=("tests/test_checkpoint.py::test_real_full_tmpfs_during_a_fit",),
    ),
    Mutation(
        name="faults: a resumed run does not restore the torch RNG",
        file="src/periodic_rl/module.py",
        old='            torch.set_rng_state(state["torch_rng"])\n',
        new="            pass\n",
        tests=(
            "tests/test_trainer_kill.py::"
            "test_trainer_killed_mid_iteration_resumes_as_if_never_killed",
        ),
    ),
    Mutation(
        name="an iteration that lost a group trains on the rest (no completeness check)",
        file="src/periodic_rl/rollout/producer.py",
        old="        if len(received) != len(owner):",
        new="        if False:",
        tests=("tests/rollout/test_producer.py",),
    ),
    Mutation(
        name="worker restarts counted over the whole run, not in a row",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old="                    slot.failures = 0\n",
        new="",
        tests=("tests/rollout/test_faults.py::test_restarts_count_in_a_row_not_over_the_run",),
    ),
    Mutation(
        name="a GPU run's vLLM keeps the CPU settings (device defaults ignored)",
        file="src/periodic_rl/rollout/device_defaults.py",
        old="        defaults = dict(GPU_VLLM if on_gpu else CPU_VLLM)",
        new="        defaults = dict(CPU_VLLM)",
        tests=("tests/rollout/test_device_defaults.py",),
    ),
    Mutation(
        name="the local Ray hands the training ranks' GPUs to workers",
        file="src/periodic_rl/rollout/device_defaults.py",
        old="    free = [i for i in range(total) if i not in set(trainer_gpus)]",
        new="    free = list(range(total))",
        tests=("tests/rollout/test_device_defaults.py",),
    ),
    Mutation(
        name="a broadcast receiver takes the buckets in reverse order",
        file="src/periodic_rl/weight_sync/broadcast.py",
        old="        works = []\n        for bucket in plan.buckets:\n",
        new="        works = []\n        for bucket in reversed(plan.buckets):\n",
        tests=(
            "tests/weight_sync/test_broadcast.py::"
            "test_two_processes_exchange_tensors_on_loopback_only",
        ),
    ),
    Mutation(
        name="the broadcast group is not re-formed after a worker restart",
        file="src/periodic_rl/rollout/ray_broadcast.py",
        old="        members = (backend, *((s.index, s.incarnation) for s in slots))",
        new="        members = (backend, *(s.index for s in slots))",
        tests=(
            "tests/rollout/test_broadcast_push.py::"
            "test_killed_worker_is_restarted_and_the_group_reformed",
        ),
    ),
    Mutation(
        name="a broadcast push's worker reports what it received, not what it loaded",
        file="src/periodic_rl/rollout/worker.py",
        old="        fingerprint = self._install(engine, state_dict, version, keep)\n"
        "        del state_dict\n",
        new="        self._install(engine, state_dict, version, keep)\n"
        "        from periodic_rl.weight_sync.fingerprint import weights_fingerprint\n\n"
        "        fingerprint = self._fingerprint = weights_fingerprint(state_dict)\n"
        "        del state_dict\n",
        tests=(
            "tests/rollout/test_broadcast_push.py::test_a_tampered_load_fails_the_broadcast_push",
        ),
    ),
    Mutation(
        name="workers started outside their placement group's bundle",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old="        placed = self._placement.options(slot.index) if self._placement else {}",
        new="        placed = {}",
        tests=(
            "tests/rollout/test_cluster.py::"
            "test_workers_run_and_restart_on_the_node_with_their_resource",
        ),
    ),
    Mutation(
        name="an unplaceable placement group waited for forever instead of refused",
        file="src/periodic_rl/rollout/placement.py",
        old="            if (infeasible and waited >= infeasible_s) or waited >= timeout_s:",
        new="            if waited >= timeout_s:",
        tests=(
            "tests/rollout/test_cluster.py::"
            "test_resources_no_node_offers_fail_start_with_what_the_cluster_has",
        ),
    ),
    Mutation(
        name="a background checkpoint written from the live tensors, not a snapshot",
        file="src/periodic_rl/checkpoint.py",
        old="        copied.copy_(storage)\n        return copied",
        new="        return storage",
        tests=(
            "tests/test_checkpoint_async.py::"
            "test_file_holds_the_state_at_the_save_while_training_goes_on",
        ),
    ),
    Mutation(
        name="teardown does not wait for the background checkpoint write",
        file="src/periodic_rl/checkpoint.py",
        old="        try:\n            self.wait()\n        except Exception as error:",
        new="        try:\n            pass\n        except Exception as error:",
        tests=("tests/test_checkpoint_async.py::test_teardown_waits_for_the_write",),
    ),
    Mutation(
        name="the hardware split always overlaps",
        file="src/periodic_rl/rollout/hardware_split.py",
        old=(
            "    best = min(candidates, key=lambda c: c.predicted_s)"
            "  # min keeps the first of equals\n"
        ),
        new="    best = min(candidates, key=lambda c: (not c.overlap, c.predicted_s))\n",
        tests=("tests/rollout/test_hardware_split.py::test_rates_give_the_expected_plan",),
    ),
    Mutation(
        name="a push hashed after the put takes a worker's report as the expected fingerprint",
        file="src/periodic_rl/rollout/ray_pushes.py",
        old="            expected = weights_fingerprint(state_dict)\n",
        new="            expected = ray.get(calls[0][2])  # what the first worker reports\n",
        tests=("tests/rollout/test_ray_rollouts.py::test_fingerprint_mismatch_raises",),
    ),
    Mutation(
        name="worker_cores auto moves the workers onto their old cores",
        file="src/periodic_rl/rollout/ray_rollouts.py",
        old="            slot.cores = list(worker_cores[slot.index])\n",
        new="",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="worker_cores auto starts overlapped instead of taking turns",
        file="src/periodic_rl/rollout/split_advisor.py",
        old="num_workers, overlap=False)",
        new="num_workers, overlap=True)",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_starts_taking_turns_and_stays_where_overlap_is_not_predicted_faster",
        ),
    ),
    Mutation(
        name="worker_cores auto tries the other mode although no gain is predicted",
        file="src/periodic_rl/rollout/split_advisor.py",
        old="        apply = None if plan.chosen.same_split(self.current) else plan.chosen\n",
        new="        apply = next(c for c in plan.candidates "
        "if c.overlap != self.current.overlap)\n"
        "        apply = apply if len(self.windows) == 1 else None\n",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_starts_taking_turns_and_stays_where_overlap_is_not_predicted_faster",
        ),
    ),
    Mutation(
        name="a fit never says the efficiencies were measured (advice always 'assumed')",
        file="src/periodic_rl/rollout/hardware_split.py",
        old='                changes["efficiencies_measured"] = True\n',
        new="",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_moves_to_overlap_where_predicted_faster_then_keeps_the_fitted_choice",
        ),
    ),
    Mutation(
        name="a worker moved in place moves only the thread that was asked",
        file="src/periodic_rl/rollout/worker.py",
        old="        repin_threads(list(cores), old)\n",
        new="        os.sched_setaffinity(0, set(cores))\n        import torch\n\n"
        "        torch.set_num_threads(len(cores))\n",
        tests=("tests/rollout/test_ray_rollouts.py::test_vllm_worker_on_smollm2",),
    ),
    Mutation(
        name="the benchmark calls an overlapped run SLOWER whenever its median step is longer",
        file="benchmarks/vs_trl_report.py",
        old="    elif high < 1:\n",
        new="    elif True:\n",
        tests=("tests/test_benchmark_report.py::test_the_verdict_follows_the_paired_steps",),
    ),
    Mutation(
        name="threads pinned to one of the old cores are left behind when a process moves",
        file="src/periodic_rl/rollout/processes.py",
        old="            if os.sched_getaffinity(int(entry)) <= moved_from:\n",
        new="            if os.sched_getaffinity(int(entry)) == moved_from:\n",
        tests=(
            "tests/rollout/test_processes.py::"
            "test_repin_threads_moves_the_threads_within_the_old_cores_only",
        ),
    ),
    Mutation(
        name="worker_cores auto ignores the cached split (starts on the default one)",
        file="src/periodic_rl/strategies/rollouts_mixin.py",
        old="            if hit is not None:\n",
        new="            if False:\n",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="a removal queued between two saves of one state stops the snapshot sharing",
        file="src/periodic_rl/checkpoint.py",
        old="        pending = next((snap for _, snap in reversed(self._pending) "
        "if snap is not None), None)",
        new="        pending = self._pending[-1][1] if self._pending else None",
        tests=(
            "tests/test_checkpoint_async.py::"
            "test_modelcheckpoint_order_shares_the_snapshot_and_links_the_file",
        ),
    ),
    Mutation(
        name="last.ckpt linked to the top-k file although other values differ",
        file="src/periodic_rl/checkpoint.py",
        old="            and _same_value(source.data, data)  # the non-tensor entries too",
        new="            and True",
        tests=(
            "tests/test_checkpoint_async.py::"
            "test_a_second_save_with_other_plain_values_is_its_own_file",
        ),
    ),
    Mutation(
        name="without overlap the iteration is still cut into calls of two groups",
        file="src/periodic_rl/rollout/controller.py",
        old="        if self.options.groups_per_call is not None or self.options.overlap:\n",
        new="        if True:\n",
        tests=(
            "tests/rollout/test_schedule.py::"
            "test_without_overlap_a_worker_gets_its_share_in_one_call",
        ),
    ),
    Mutation(
        name="engine_dtype auto ignores the 10% margin (bf16 wins ties)",
        file="src/periodic_rl/rollout/engine_dtype.py",
        old='    return "bfloat16" if bf16 > 0 and bf16 >= BF16_MARGIN * f32 else "float32"',
        new='    return "bfloat16" if bf16 > 0 and bf16 >= f32 else "float32"',
        tests=("tests/rollout/test_engine_dtype.py::test_choose_dtype",),
    ),
    Mutation(
        name="a push leaves the tied lm_head's CPU kernel as built from the checkpoint",
        file="src/periodic_rl/compat/vllm.py",
        old="    refresh_tied_heads(model)\n",
        new="",
        tests=("tests/rollout/test_vllm_reload.py::test_a_pushed_engine_samples_like_a_fresh_one",),
    ),
    Mutation(
        name="the CPU engine keeps vLLM's 128-token KV blocks (a group prefills its prompt"
        " G times)",
        file="src/periodic_rl/rollout/vllm_engine.py",
        old='                llm_kwargs.setdefault("block_size", VLLM_CPU_BLOCK_SIZE)\n',
        new="                pass\n",
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_a_groups_samples_share_the_whole_blocks_of_their_prompt",
        ),
    ),
    Mutation(
        name="the report counts no time of the workers' cores lent to the trainer",
        file="src/periodic_rl/rollout/timing.py",
        old=(
            '        "cores_lent_time": measure([(s.start, s.end) for s in spans '
            "if s.lane == LOAN_LANE]),\n"
        ),
        new='        "cores_lent_time": 0.0,\n',
        tests=("tests/rollout/test_timing.py::test_summary_of_an_overlapped_iteration",),
    ),
    Mutation(
        name="the tied lm_head keeps its own stale kernel instead of its owner's",
        file="src/periodic_rl/compat/vllm.py",
        old="            module.cpu_linear = kernel\n",
        new="            pass\n",
        tests=("tests/rollout/test_vllm_reload.py::test_a_pushed_engine_samples_like_a_fresh_one",),
    ),
    Mutation(
        name="a tied lm_head is fed to vLLM's reload again (the vocabulary processed twice)",
        file="src/periodic_rl/rollout/vllm_worker.py",
        old="            tied.add(name)\n",
        new="            pass\n",
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_a_tied_push_packs_the_vocabulary_once_and_lands_bit_for_bit",
        ),
    ),
    Mutation(
        name="a fast reload leaves the tied head on the old embedding's kernel",
        file="src/periodic_rl/compat/vllm_fast_reload.py",
        old=(
            "            for module in (embedding, *tied):\n"
            "                module.cpu_linear = None\n"
            "            embedding.quant_method.process_weights_after_loading(embedding)\n"
            "            for module in tied:\n"
            "                module.cpu_linear = embedding.cpu_linear\n"
        ),
        new="            embedding.quant_method.process_weights_after_loading(embedding)\n",
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_the_fast_full_reload_builds_the_kernels_vllms_reload_builds",
        ),
    ),
    Mutation(
        name="a fast reload packs a fused layer before all its shards arrived",
        file="src/periodic_rl/compat/vllm_fast_reload.py",
        old='if state["loaded"] >= meta.numel():',
        new='if state["loaded"] >= 1:',
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_the_fast_full_reload_builds_the_kernels_vllms_reload_builds",
        ),
    ),
    Mutation(
        name="a fast reload packs o_proj/down_proj from the staging buffer it never filled",
        file="src/periodic_rl/compat/vllm_fast_reload.py",
        old='source = staged if state["pushed"] is None else state["pushed"]',
        new="source = staged",
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_the_fast_full_reload_builds_the_kernels_vllms_reload_builds",
        ),
    ),
    Mutation(
        name="a restart after the trainer's step reads its changed weights (no lasting copy)",
        file="src/periodic_rl/rollout/ray_pushes.py",
        old="            self._pushed = replace(pending.pushed, base=ref)\n",
        new="            pass\n",
        tests=(
            "tests/rollout/test_ray_rollouts.py::"
            "test_a_full_push_reaches_local_workers_through_shared_memory_and_restarts_outlive_it",
        ),
    ),
    Mutation(
        name="the optimizer step begins while the restart copy still reads the weights",
        file="src/periodic_rl/strategies/rollouts_mixin.py",
        old="        self.rollouts.weights_will_change()\n",
        new="",
        tests=(
            "tests/strategies/test_periodic_async.py::"
            "test_an_optimizer_step_waits_for_the_last_shared_pushs_restart_copy",
        ),
    ),
    Mutation(
        name="full pushes to workers on this machine copied through the object store",
        file="src/periodic_rl/rollout/ray_pushes.py",
        old="        return share(state_dict)\n",
        new="        return None\n",
        tests=(
            "tests/strategies/test_periodic_async.py::"
            "test_an_optimizer_step_waits_for_the_last_shared_pushs_restart_copy",
        ),
    ),
    Mutation(
        name="a vLLM engine whose weight load failed midway still claims the old weights",
        file="src/periodic_rl/rollout/vllm_engine.py",
        old="            self._fingerprint = UNKNOWN_WEIGHTS",
        new="            pass",
        tests=(
            "tests/rollout/test_engine_fingerprints.py::"
            "test_vllm_reload_that_loses_or_changes_a_tensor_reports_other_weights",
        ),
    ),
    Mutation(
        name="the trainer borrows the worker's cores before the iteration is generated",
        file="src/periodic_rl/rollout/controller.py",
        old="                if stream.closed:  # everything generated: the workers are idle",
        new="                if True:",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="the trainer borrows the worker's cores mid-micro-batch before generation ends",
        file="src/periodic_rl/rollout/controller.py",
        old="lambda: stream.closed",
        new="lambda: True",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="the trainer lends only at micro-batch boundaries (no lend points inside one)",
        file="src/periodic_rl/rollout/core_loan.py",
        old="    with torch.autograd.graph.saved_tensors_hooks(point, point):\n        yield\n",
        new="    yield\n",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_a_loan_begins_inside_the_backward_that_was_training_when_generation_ended",
        ),
    ),
    Mutation(
        name="the borrowed cores are kept through the push",
        file="src/periodic_rl/rollout/controller.py",
        old="        self._give_back()  # the workers load the weights, then generate\n",
        new="",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="a loan moves the threads but not torch's thread pool",
        file="src/periodic_rl/rollout/core_loan.py",
        old="        torch.set_num_threads(len(wide))\n",
        new="",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_a_loan_widens_the_trainers_threads_and_gives_them_back",
        ),
    ),
    Mutation(
        name="AdamW not fused on the CPU (torch's slower per-operation loop)",
        file="src/periodic_rl/optim.py",
        old="fused=(fused_supported(params) and fused_allowed(module)) or None,",
        new="fused=None,",
        tests=("tests/test_optimizers.py::test_constant_by_default",),
    ),
    Mutation(
        name="the workers never borrow the waiting trainer's cores for a weight load",
        file="src/periodic_rl/rollout/controller.py",
        old="loads_borrow_trainer_cores=bool(lendable_cores(o, self.link.world_size)),",
        new="loads_borrow_trainer_cores=False,",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="a worker keeps the trainer's cores after loading a push",
        file="src/periodic_rl/rollout/worker.py",
        old="        finally:\n            loan.give_back()\n",
        new="        finally:\n            pass\n",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_a_worker_loads_on_borrowed_cores_and_hands_them_back",
        ),
    ),
    Mutation(
        name="a fixed split's advice ignores the efficiencies an auto run measured",
        file="src/periodic_rl/strategies/rollouts_mixin.py",
        old="model=known.model if known else None,",
        new="model=None,",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="fused AdamW under a loss scaler (16-mixed: it would unscale after clipping)",
        file="src/periodic_rl/optim.py",
        old="return unscaled_amp or type(plugin) in (Precision, HalfPrecision, DoublePrecision)",
        new="return True",
        tests=("tests/test_optimizers.py::test_fused_only_under_plugins_without_a_loss_scaler",),
    ),
    Mutation(
        name="bf16-mixed leaves fused AdamW (0.25 s a step instead of 0.07 on SmolLM2)",
        file="src/periodic_rl/optim.py",
        old="    unscaled_amp = _unscaled_amp(plugin)\n",
        new="    unscaled_amp = False\n",
        tests=("tests/test_optimizers.py::test_bf16_mixed_keeps_the_fused_kernel_and_clips",),
    ),
    Mutation(
        name="bf16-mixed with fused AdamW does not clip the gradients",
        file="src/periodic_rl/optim.py",
        old="Precision.clip_gradients(plugin, optimizer, max_norm, GradClipAlgorithmType.NORM)",
        new="None",
        tests=("tests/test_optimizers.py::test_bf16_mixed_keeps_the_fused_kernel_and_clips",),
    ),
    Mutation(
        name="CPU attention of an autocast forward left to autocast's bf16 kernel (2-3x slower)",
        file="src/periodic_rl/attention/backends.py",
        old='        if torch.is_autocast_enabled("cpu"):',
        new="        if False:",
        tests=(
            "tests/attention/test_kernels.py::"
            "test_cpu_half_precision_attends_in_float32[True-split]",
        ),
    ),
    Mutation(
        name="CPU attention of bf16 inputs computed in bf16",
        file="src/periodic_rl/attention/backends.py",
        old="            out = fn(q.float(), k.float(), v.float(), layout, opt)",
        new="            out = fn(q, k, v, layout, opt)",
        tests=(
            "tests/attention/test_kernels.py::"
            "test_cpu_half_precision_attends_in_float32[False-sdpa]",
        ),
    ),
    Mutation(
        name="keep_freed_memory leaves mmap on (large buffers faulted in again every time)",
        file="src/periodic_rl/heap.py",
        old="return bool(mallopt(M_MMAP_MAX, 0)) and bool(",
        new="return bool(",
        tests=("tests/test_heap.py::test_a_freed_buffer_is_reused_without_page_faults",),
    ),
    Mutation(
        name="keep_freed_memory overrides an allocator the environment chose",
        file="src/periodic_rl/heap.py",
        old=' != "glibc" or allocator_chosen():',
        new=' != "glibc":',
        tests=("tests/test_heap.py::test_an_allocator_chosen_by_the_environment_is_left_alone",),
    ),
    Mutation(
        name="a CPU trainer does not keep freed memory",
        file="src/periodic_rl/strategies/rollouts_mixin.py",
        old="            keep_freed_memory()  # each step",
        new="            pass  # each step",
        tests=("tests/test_heap.py::test_a_cpu_trainer_keeps_freed_memory",),
    ),
]


def copy_tree(destination: Path) -> None:
    """The tracked files under :data:`COPIED`, as they are in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *COPIED],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # tracked but deleted in the working tree: skip
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def mutated(mutation: Mutation, text: str) -> str:
    """``text`` with the mutation applied; refuses unless ``old`` occurs exactly once."""
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(
            f"mutation {mutation.name!r}: the original text occurs {count} times in "
            f"{mutation.file} (expected once); update the row in tests/mutations.py"
        )
    return text.replace(mutation.old, mutation.new)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.file
    path.write_text(mutated(mutation, path.read_text()))


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree / "src")
    env.pop("RAY_ADDRESS", None)
    return env


def check_import(tree: Path) -> None:
    """The child must import the copy's ``periodic_rl``, not the editable install's."""
    found = subprocess.run(
        [sys.executable, "-c", "import periodic_rl; print(periodic_rl.__file__)"],
        cwd=tree,
        env=child_env(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to((tree / "src").resolve()):
        raise SystemExit(f"the child imports periodic_rl from {found}, not from {tree / 'src'}")


def run_tests(tree: Path, tests: tuple[str, ...], stop_early: bool) -> tuple[str, float, str]:
    """Run ``tests`` in ``tree``; returns (outcome, seconds, output tail). Outcomes: ``passed``,
    ``failed`` (a test failed, or collection failed), ``error`` (no such test, usage error),
    ``timeout``."""
    missing = [t for t in tests if not (tree / t.split("::")[0]).exists()]
    if missing:
        return "error", 0.0, f"no such test file: {', '.join(missing)}"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    if stop_early:
        command.insert(4, "-x")
    began = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=child_env(tree),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - began, ""
    seconds = time.monotonic() - began
    lines = (done.stdout + done.stderr).strip().splitlines()
    errors = [  # why the tests failed
        line for line in lines if line.startswith("E ") and re.search(r"Error|assert|Failed", line)
    ][:4]
    tail = "\n".join(errors + lines[-8:])
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(done.returncode, "error")
    return outcome, seconds, tail


def fresh_tree() -> Path:
    tree = Path(tempfile.mkdtemp(prefix="periodic-rl-mutation-"))
    copy_tree(tree)
    check_import(tree)
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only mutations whose name contains these")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--verbose", action="store_true", help="show how each one was caught")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(n in m.name for n in args.names)]
    if args.list or not chosen:
        for mutation in MUTATIONS:
            print(f"{mutation.name}: {mutation.file} -> {', '.join(mutation.tests)}")
        return 0 if chosen else 2
    for mutation in chosen:  # every row still applies to today's sources, before anything runs
        mutated(mutation, (ROOT / mutation.file).read_text())

    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        tree = fresh_tree()
        try:
            present = tuple(t for t in tests if (tree / t.split("::")[0]).exists())
            outcome, seconds, tail = run_tests(tree, present, stop_early=False)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        print(
            f"baseline (unmutated, {len(present)} test ids): {outcome} in {seconds:.0f} s",
            flush=True,
        )
        if outcome != "passed":
            print(tail)
            print("the tests fail without any mutation: fix them first")
            return 1

    rows = []
    for mutation in chosen:
        tree = fresh_tree()
        try:
            apply(mutation, tree)
            outcome, seconds, tail = run_tests(tree, mutation.tests, stop_early=True)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        verdict = {"failed": "caught"}.get(outcome, f"NOT caught ({outcome})")
        rows.append((mutation.name, verdict, seconds))
        print(f"{verdict:<24} {seconds:6.0f} s  {mutation.name}", flush=True)
        if outcome != "failed" or args.verbose:
            print("  " + tail.replace("\n", "\n  "), flush=True)

    width = max(len(name) for name, _, _ in rows)
    print(f"\n| {'mutation':<{width}} | {'result':<24} | {'seconds':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 26}|{'-' * 9}|")
    for name, verdict, seconds in rows:
        print(f"| {name:<{width}} | {verdict:<24} | {seconds:7.0f} |")
    survivors = sum(not verdict.startswith("caught") for _, verdict, _ in rows)
    print(f"\n{len(rows) - survivors} of {len(rows)} mutations caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
