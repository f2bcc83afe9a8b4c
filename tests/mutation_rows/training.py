"""Mutation rows of the module, the loss, the attention, checkpoints, data, rewards and the
sandbox: every file outside ``rollout/``, ``strategies/``, ``weight_sync/`` and ``compat/``."""

from __future__ import annotations

from mutation_rows.base import DISTRIBUTED_TESTS, STALENESS_TESTS, STRATEGY_TESTS, Mutation

ROWS: list[Mutation] = [
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
        old="rollout_micro_batches(request, self.micro_batch_size, ahead)",
        new="rollout_micro_batches(request, self.hparams.micro_batch_size, ahead)",
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
        name="a failing training step does not stop the iteration's generation",
        file="src/periodic_rl/module.py",
        old="        with closing(micro_batches):",
        new="        if True:",
        tests=("tests/test_module.py::test_failing_training_step_stops_the_iteration_generation",),
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
        name="multi-turn: environment tokens not masked out of the loss",
        file="src/periodic_rl/loss_mask.py",
        old="    return mask * loss\n",
        new="    return mask\n",
        tests=("tests/test_loss_mask.py::test_environment_tokens_are_out_of_the_update[dapo]",),
    ),
    Mutation(
        name="multi-turn: environment tokens counted in the token normaliser",
        file="src/periodic_rl/iteration.py",
        old="        model_tokens = self.num_tokens - self.masked_tokens\n",
        new="        model_tokens = self.num_tokens\n",
        tests=("tests/test_loss_mask.py::test_environment_tokens_are_out_of_the_update[dapo]",),
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
        name="num_iterations: later updates take the current log-probs as the old policy",
        file="src/periodic_rl/micro_batch.py",
        old="            first.old_logps,\n",
        new="            logps.detach(),\n",
        tests=(
            "tests/test_num_iterations.py::test_two_updates_equal_the_written_out_two_epoch_computation",
        ),
    ),
    Mutation(
        name="num_iterations: every inner step publishes the weights",
        file="src/periodic_rl/module.py",
        old="        optimizer.step()\n",
        new=(
            "        optimizer.step()\n"
            "        self.rollout_strategy().publish(self.trainer.global_step)\n"
        ),
        tests=(
            "tests/test_num_iterations.py::test_two_updates_equal_the_written_out_two_epoch_computation",
        ),
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
        old="                self._failures[name] += 1\n                self._first_failure",
        new="                self._first_failure",
        tests=(
            "tests/test_scoring.py::"
            "test_training_run_with_a_failing_reward_finishes_and_logs_the_exact_count",
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
        name="the benchmark calls an overlapped run SLOWER whenever its median step is longer",
        file="benchmarks/vs_trl_report.py",
        old="    elif high < 1:\n",
        new="    elif True:\n",
        tests=("tests/test_benchmark_report.py::test_the_verdict_follows_the_paired_steps",),
    ),
    Mutation(
        name="the benchmark runs its configurations in the same order in every repeat",
        file="benchmarks/vs_trl.py",
        old="    shift = repeat % len(configs)\n",
        new="    shift = 0\n",
        tests=(
            "tests/test_benchmark_harness.py::"
            "test_each_configuration_runs_in_every_place_of_the_order",
        ),
    ),
    Mutation(
        name="the benchmark leaves a finished run's helpers running into the next run",
        file="benchmarks/child_runs.py",
        old="    for proc in remaining:\n        try:\n            proc.kill()\n",
        new="    for proc in remaining:\n        try:\n            pass\n",
        tests=(
            "tests/test_benchmark_harness.py::"
            "test_what_a_finished_run_left_in_its_session_is_reaped",
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
        name="AdamW not fused on the CPU (torch's slower per-operation loop)",
        file="src/periodic_rl/optim.py",
        old="fused=(fused_supported(params) and fused_allowed(module)) or None,",
        new="fused=None,",
        tests=("tests/test_optimizers.py::test_constant_by_default",),
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
]
