"""Mutation rows of the rollout side (``src/periodic_rl/rollout/``): the controller, the Ray
workers, placement, the hardware split, timing."""

from __future__ import annotations

from mutation_rows.base import STALENESS_TESTS, STRATEGY_TESTS, Mutation

ROWS: list[Mutation] = [
    Mutation(
        name="overlap switched off (the trainer always waits for the whole iteration)",
        file="src/periodic_rl/rollout/controller.py",
        old="            if not self.overlap:\n",
        new="            if True:\n",
        tests=(f"{STRATEGY_TESTS}::test_training_starts_before_the_last_group_is_generated",),
    ),
    Mutation(
        name="a killed worker's lost calls are not sent again",
        file="src/periodic_rl/rollout/workers/generation.py",
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
        file="src/periodic_rl/rollout/workers/generation.py",
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
        file="src/periodic_rl/rollout/engines/hf_engine.py",
        old="loaded_fingerprint(state_dict, {n: held[n] for n in state_dict if n in held})",
        new="weights_fingerprint(state_dict)",
        tests=("tests/rollout/test_engine_fingerprints.py",),
    ),
    Mutation(
        name="vLLM worker fingerprints what it received, not what its loader took in",
        file="src/periodic_rl/rollout/engines/vllm_worker.py",
        old="    return loaded_fingerprint(received, held)\n",
        new=(
            "    from periodic_rl.weight_sync.fingerprint import weights_fingerprint\n\n"
            "    return weights_fingerprint(received)\n"
        ),
        tests=("tests/rollout/test_engine_fingerprints.py",),
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
        name="in-process rollouts trust the engine's fingerprint unchecked",
        file="src/periodic_rl/rollout/local.py",
        old="        if fingerprint != expected:\n",
        new="        if False:\n",
        tests=("tests/rollout/test_local.py",),
    ),
    Mutation(
        name="bounded staleness: the schedule lags 2k versions instead of k",
        file="src/periodic_rl/rollout/schedule.py",
        old="(iteration - self.max_staleness) * self.steps_per_iteration",
        new="(iteration - 2 * self.max_staleness) * self.steps_per_iteration",
        tests=(
            "tests/rollout/test_pipeline.py::test_iterations_run_ahead_on_the_fixed_schedule",
            f"{STALENESS_TESTS}::test_k1_overlapped_equals_synchronous_on_the_fixed_schedule",
        ),
    ),
    Mutation(
        name="bounded staleness: the checkpoint keeps no older weights",
        file="src/periodic_rl/rollout/controller.py",
        old="        if not pending:\n            return {}\n",
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
        name="a local Ray started on the machine's routable address (not loopback)",
        file="src/periodic_rl/rollout/workers/placement.py",
        old="    with all_cores(), gpus, loopback_node() if loopback else nullcontext():\n",
        new="    with all_cores(), gpus, nullcontext():\n",
        tests=("tests/rollout/test_network.py::test_a_local_run_listens_on_loopback_only[hf]",),
    ),
    Mutation(
        name="soak: a run's own local Ray is left running after the fit",
        file="src/periodic_rl/rollout/workers/rollouts.py",
        old="                ray.shutdown()\n                self._owns_ray = False\n",
        new="                self._owns_ray = False\n",
        tests=("tests/test_soak.py",),
    ),
    Mutation(
        name="bad input: the prompt-length check forgets max_new_tokens",
        file="src/periodic_rl/rollout/engines/engine_checks.py",
        old="            if length + max_new_tokens > max_len:\n",
        new="            if length > max_len:\n",
        tests=(
            "tests/rollout/test_engine_checks.py::"
            "test_prompt_longer_than_max_model_len_names_the_row_and_the_fixes",
        ),
    ),
    Mutation(
        name="bad input: the KV-cache check ignores the group's size",
        file="src/periodic_rl/rollout/engines/engine_checks.py",
        old="    blocks = max(num_generations * _blocks(",
        new="    blocks = max(0 * _blocks(",
        tests=(
            "tests/rollout/test_engine_checks.py::"
            "test_kv_cache_too_small_for_one_group_names_kv_cache_gb_and_the_minimum",
        ),
    ),
    Mutation(
        name="faults: a hung rollout call is never timed out",
        file="src/periodic_rl/rollout/workers/generation.py",
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
        name="an iteration that lost a group trains on the rest (no completeness check)",
        file="src/periodic_rl/rollout/producer.py",
        old="        if len(received) != len(owner):",
        new="        if False:",
        tests=("tests/rollout/test_producer.py",),
    ),
    Mutation(
        name="worker restarts counted over the whole run, not in a row",
        file="src/periodic_rl/rollout/workers/generation.py",
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
        name="the broadcast group is not re-formed after a worker restart",
        file="src/periodic_rl/rollout/workers/broadcast.py",
        old="        members = (backend, *((s.index, s.incarnation) for s in slots))",
        new="        members = (backend, *(s.index for s in slots))",
        tests=(
            "tests/rollout/test_broadcast_push.py::"
            "test_killed_worker_is_restarted_and_the_group_reformed",
        ),
    ),
    Mutation(
        name="a broadcast push's worker reports what it received, not what it loaded",
        file="src/periodic_rl/rollout/workers/worker.py",
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
        file="src/periodic_rl/rollout/workers/rollouts.py",
        old="        placed = self._placement.options(slot.index) if self._placement else {}",
        new="        placed = {}",
        tests=(
            "tests/rollout/test_cluster.py::"
            "test_workers_run_and_restart_on_the_node_with_their_resource",
        ),
    ),
    Mutation(
        name="an unplaceable placement group waited for forever instead of refused",
        file="src/periodic_rl/rollout/workers/placement.py",
        old="            if (infeasible and waited >= infeasible_s) or waited >= timeout_s:",
        new="            if waited >= timeout_s:",
        tests=(
            "tests/rollout/test_cluster.py::"
            "test_resources_no_node_offers_fail_start_with_what_the_cluster_has",
        ),
    ),
    Mutation(
        name="the hardware split always overlaps",
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old=(
            "    best = min(candidates, key=lambda c: c.predicted_s)"
            "  # min keeps the first of equals\n"
        ),
        new="    best = min(candidates, key=lambda c: (not c.overlap, c.predicted_s))\n",
        tests=("tests/rollout/test_hardware_split.py::test_rates_give_the_expected_plan",),
    ),
    Mutation(
        name="a push hashed after the put takes a worker's report as the expected fingerprint",
        file="src/periodic_rl/rollout/workers/pushes.py",
        old="            expected = weights_fingerprint(state_dict)\n",
        new="            expected = ray.get(calls[0][2])  # what the first worker reports\n",
        tests=("tests/rollout/test_ray_rollouts.py::test_fingerprint_mismatch_raises",),
    ),
    Mutation(
        name="worker_cores auto moves the workers onto their old cores",
        file="src/periodic_rl/rollout/workers/rollouts.py",
        old="            slot.cores = list(worker_cores[slot.index])\n",
        new="",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="worker_cores auto starts overlapped instead of taking turns",
        file="src/periodic_rl/cpu_tuning/split_advisor.py",
        old="num_workers, overlap=False)",
        new="num_workers, overlap=True)",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_starts_taking_turns_and_stays_where_overlap_is_not_predicted_faster",
        ),
    ),
    Mutation(
        name="worker_cores auto tries the other mode although no gain is predicted",
        file="src/periodic_rl/cpu_tuning/split_advisor.py",
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
        file="src/periodic_rl/cpu_tuning/hardware_split.py",
        old='                changes["efficiencies_measured"] = True\n',
        new="",
        tests=(
            "tests/rollout/test_split_advisor.py::"
            "test_auto_moves_to_overlap_where_predicted_faster_then_keeps_the_fitted_choice",
        ),
    ),
    Mutation(
        name="a worker moved in place moves only the thread that was asked",
        file="src/periodic_rl/rollout/workers/worker.py",
        old="        repin_threads(list(cores), old)\n",
        new="        os.sched_setaffinity(0, set(cores))\n        import torch\n\n"
        "        torch.set_num_threads(len(cores))\n",
        tests=("tests/rollout/test_ray_rollouts.py::test_vllm_worker_on_smollm2",),
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
        name="without overlap the iteration is still cut into calls of two groups",
        file="src/periodic_rl/rollout/controller.py",
        old="        if self.options.groups_per_call is not None or self.overlap:\n",
        new="        if True:\n",
        tests=(
            "tests/rollout/test_schedule.py::"
            "test_without_overlap_a_worker_gets_its_share_in_one_call",
        ),
    ),
    Mutation(
        name="engine_dtype auto ignores the 10% margin (bf16 wins ties)",
        file="src/periodic_rl/cpu_tuning/engine_dtype.py",
        old='    return "bfloat16" if bf16 > 0 and bf16 >= BF16_MARGIN * f32 else "float32"',
        new='    return "bfloat16" if bf16 > 0 and bf16 >= f32 else "float32"',
        tests=("tests/rollout/test_engine_dtype.py::test_choose_dtype",),
    ),
    Mutation(
        name="the CPU engine keeps vLLM's 128-token KV blocks (a group prefills its prompt"
        " G times)",
        file="src/periodic_rl/rollout/engines/vllm_engine.py",
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
        old='        "cores_lent_time": measure(lent),\n',
        new='        "cores_lent_time": 0.0,\n',
        tests=("tests/rollout/test_timing.py::test_summary_of_an_overlapped_iteration",),
    ),
    Mutation(
        name="a tied lm_head is fed to vLLM's reload again (the vocabulary processed twice)",
        file="src/periodic_rl/rollout/engines/vllm_worker.py",
        old="            tied.add(name)\n",
        new="            pass\n",
        tests=(
            "tests/rollout/test_vllm_engine.py::"
            "test_a_tied_push_packs_the_vocabulary_once_and_lands_bit_for_bit",
        ),
    ),
    Mutation(
        name="a restart after the trainer's step reads its changed weights (no lasting copy)",
        file="src/periodic_rl/rollout/workers/pushes.py",
        old="            self._pushed = replace(pending.pushed, base=ref)\n",
        new="            pass\n",
        tests=(
            "tests/rollout/test_ray_rollouts.py::"
            "test_a_full_push_reaches_local_workers_through_shared_memory_and_restarts_outlive_it",
        ),
    ),
    Mutation(
        name="full pushes to workers on this machine copied through the object store",
        file="src/periodic_rl/rollout/workers/pushes.py",
        old="        return share(state_dict)\n",
        new="        return None\n",
        tests=(
            "tests/strategies/test_periodic_async.py::"
            "test_an_optimizer_step_waits_for_the_last_shared_pushs_restart_copy",
        ),
    ),
    Mutation(
        name="a vLLM engine whose weight load failed midway still claims the old weights",
        file="src/periodic_rl/rollout/engines/vllm_engine.py",
        old="            self._fingerprint = UNKNOWN_WEIGHTS",
        new="            pass",
        tests=(
            "tests/rollout/test_engine_fingerprints.py::"
            "test_vllm_reload_that_loses_or_changes_a_tensor_reports_other_weights",
        ),
    ),
    Mutation(
        name="the trainer borrows the worker's cores before the iteration is generated",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="        if generation_done():\n            self.loan.lend(cores)\n",
        new="        if True:\n            self.loan.lend(cores)\n",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="the trainer borrows the worker's cores mid-micro-batch before generation ends",
        file="src/periodic_rl/rollout/controller.py",
        old="lambda: pipeline.idle",
        new="lambda: True",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="the trainer lends only at micro-batch boundaries (no lend points inside one)",
        file="src/periodic_rl/cpu_tuning/core_loan.py",
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
        old="        self.tuning.before_push()  # the workers load the weights, then generate\n",
        new="",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="a loan moves the threads but not torch's thread pool",
        file="src/periodic_rl/rollout/processes.py",
        old="        torch.set_num_threads(len(wide))\n",
        new="",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_a_loan_widens_the_trainers_threads_and_gives_them_back",
        ),
    ),
    Mutation(
        name="the workers never borrow the waiting trainer's cores for a weight load",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="        return sorted(os.sched_getaffinity(0)) if self._lendable else None\n",
        new="        return None\n",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_loans_fall_between_generation_and_push_and_change_no_update",
        ),
    ),
    Mutation(
        name="a worker keeps the trainer's cores after loading a push",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="        finally:\n            loan.give_back()\n",
        new="        finally:\n            pass\n",
        tests=(
            "tests/rollout/test_core_loan.py::"
            "test_a_worker_loads_on_borrowed_cores_and_hands_them_back",
        ),
    ),
]
