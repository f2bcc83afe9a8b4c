"""Rows of multi-turn rollouts: the agent loop, the tools, the rendering and the prompts."""

from __future__ import annotations

from mutation_rows.base import Mutation

LOOP_TESTS = "tests/agents/test_loop.py"
TOOL_LOOP_TESTS = "tests/agents/test_tool_loop.py"
INVARIANT_TESTS = "tests/agents/test_multi_turn_invariants.py"
RENDERING_TESTS = ("tests/agents/test_rendering.py", "tests/agents/test_family_templates.py")

ROWS: list[Mutation] = [
    Mutation(
        name="agent loop: environment tokens marked as the model's in the loss mask",
        file="src/periodic_rl/agents/loop.py",
        old="        self.mask += [0] * len(ids)\n",
        new="        self.mask += [1] * len(ids)\n",
        tests=(LOOP_TESTS,),
    ),
    Mutation(
        name="agent loop: a round waits for every environment step before generating again",
        file="src/periodic_rl/agents/loop.py",
        old=(
            "            if not ready:\n"
            "                began = time.monotonic()\n"
            "                wait(pending, timeout=self._next_deadline(pending), "
            "return_when=FIRST_COMPLETED)\n"
        ),
        new=(
            "            if pending:\n"
            "                began = time.monotonic()\n"
            "                wait(pending, timeout=self._next_deadline(pending), "
            'return_when="ALL_COMPLETED")\n'
        ),
        tests=(LOOP_TESTS,),
    ),
    Mutation(
        name="agent loop: the model's turn re-tokenized from its text",
        file="src/periodic_rl/agents/loop.py",
        old="            state.ids += tokens\n",
        new="            state.ids += self.renderer.encode(self.renderer.decode(tokens))\n",
        tests=(LOOP_TESTS,),
    ),
    Mutation(
        name="tools: a failing tool call is not counted as an error",
        file="src/periodic_rl/agents/environment.py",
        old="            errors += int(result.error)\n",
        new="            errors += 0\n",
        tests=(TOOL_LOOP_TESTS,),
    ),
    Mutation(
        name="rendering: a template that is not prefix-stable is accepted",
        file="src/periodic_rl/agents/rendering.py",
        old="        if not text.startswith(prefix):\n",
        new="        if False:\n",
        tests=RENDERING_TESTS,
    ),
    Mutation(
        name="rendering: a template without a tool role is accepted with tools",
        file="src/periodic_rl/agents/rendering.py",
        old="            self._check_tool_replies()\n",
        new="            pass\n",
        tests=RENDERING_TESTS,
    ),
    Mutation(
        name="rendering: the EOS a template writes after the last message is kept in the prefix",
        file="src/periodic_rl/agents/rendering.py",
        old="            if continued.startswith(opened):\n",
        new="            if False:\n",
        tests=RENDERING_TESTS,
    ),
    Mutation(
        name="prompts: a multi-turn prompt over max_prompt_length is accepted",
        file="src/periodic_rl/agents/prompts.py",
        old="    if long:\n",
        new="    if False:\n",
        tests=("tests/agents/test_multi_turn_training.py",),
    ),
    Mutation(
        name="agent rollouts: a restarted rollout worker is built without the agent config",
        file="src/periodic_rl/rollout/workers/rollouts.py",
        old="        ).remote(slot.index, self.spec, slot.cores, self.worker_tuning, self.agent)\n",
        new=(
            "        ).remote(slot.index, self.spec, slot.cores, self.worker_tuning, "
            "None if slot.incarnation else self.agent)\n"
        ),
        tests=(
            f"{INVARIANT_TESTS}::test_worker_killed_mid_trajectory_gives_the_fault_free_update",
        ),
    ),
]
