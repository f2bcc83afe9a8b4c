"""Mutation rows of the strategies, the weight pushes, the compatibility shims and the trainer
process's heap."""

from __future__ import annotations

from mutation_rows.base import DISTRIBUTED_TESTS, Mutation

ROWS: list[Mutation] = [
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
        name="FSDP push without gathering the shards",
        file="src/periodic_rl/strategies/distributed.py",
        old="fsdp2_full_tensor, self.global_rank)\n",
        new="None, self.global_rank)\n",
        tests=(f"{DISTRIBUTED_TESTS}::test_two_fsdp_ranks_equal_one_rank",),
    ),
    Mutation(
        name="rendezvous store on every interface (torch's own env:// store)",
        file="src/periodic_rl/compat/torch_distributed.py",
        old='        kwargs["store"] = _store(',
        new="        _ = (",
        tests=("tests/compat/test_torch_distributed.py",),
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
        name="worker_cores auto ignores the cached split (starts on the default one)",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="            if hit is not None:  # start on the split a run of this workload chose\n",
        new="            if False:\n",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="a push leaves the tied lm_head's CPU kernel as built from the checkpoint",
        file="src/periodic_rl/compat/vllm.py",
        old="    refresh_tied_heads(model)\n",
        new="",
        tests=(
            "tests/rollout/test_vllm_reload.py::"
            "test_a_pushed_engine_samples_like_a_fresh_one[vllm reload]",
        ),
    ),
    Mutation(
        name="the tied lm_head keeps its own stale kernel instead of its owner's",
        file="src/periodic_rl/compat/vllm.py",
        old="            module.cpu_linear = kernel\n",
        new="            pass\n",
        tests=(
            "tests/rollout/test_vllm_reload.py::"
            "test_a_pushed_engine_samples_like_a_fresh_one[vllm reload]",
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
        name="a fixed split's advice ignores the efficiencies an auto run measured",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="model=known.model if known else None,",
        new="model=None,",
        tests=(
            "tests/strategies/test_auto_split.py::"
            "test_auto_split_switches_twice_and_trains_as_a_fixed_split",
        ),
    ),
    Mutation(
        name="keep_freed_memory leaves mmap on (large buffers faulted in again every time)",
        file="src/periodic_rl/cpu_tuning/heap.py",
        old="return bool(mallopt(M_MMAP_MAX, 0)) and bool(",
        new="return bool(",
        tests=("tests/test_heap.py::test_a_freed_buffer_is_reused_without_page_faults",),
    ),
    Mutation(
        name="keep_freed_memory overrides an allocator the environment chose",
        file="src/periodic_rl/cpu_tuning/heap.py",
        old="    if not uses_glibc() or allocator_chosen():",
        new="    if not uses_glibc():",
        tests=("tests/test_heap.py::test_an_allocator_chosen_by_the_environment_is_left_alone",),
    ),
    Mutation(
        name="a CPU trainer does not keep freed memory",
        file="src/periodic_rl/cpu_tuning/plugin.py",
        old="        keep_freed_memory()  # each step",
        new="        pass  # each step",
        tests=("tests/test_heap.py::test_a_cpu_trainer_keeps_freed_memory",),
    ),
]
