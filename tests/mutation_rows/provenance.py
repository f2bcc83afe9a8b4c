"""Rows of what a user checks a run with: the engine/trainer mismatch metrics, the rollout
record, the replay of a recorded iteration."""

from __future__ import annotations

from mutation_rows.base import Mutation

ROWS: list[Mutation] = [
    Mutation(
        name="mismatch: the ratio's maximum is summed over micro-batches, not kept",
        file="src/periodic_rl/iteration.py",
        old="                self.loss[name] = max(self.loss.get(name, value), value)\n",
        new="                self.loss[name] += value\n",
        tests=("tests/test_mismatch.py",),
    ),
    Mutation(
        name="mismatch: a micro-batch without behaviour log-probs counts no missing tokens",
        file="src/periodic_rl/micro_batch.py",
        old='        stats["mismatch_missing_tokens"] = mask.sum()\n',
        new="        pass\n",
        tests=("tests/test_mismatch.py",),
    ),
    Mutation(
        name="mismatch: the effective sample size is not normalised by the token count",
        file="src/periodic_rl/algorithms/mismatch.py",
        old='(tokens * sums["mismatch_ratio_sq_sum"]),\n',
        new='sums["mismatch_ratio_sq_sum"],\n',
        tests=("tests/test_mismatch.py",),
    ),
    Mutation(
        name="record: the behaviour log-probs are dropped",
        file="src/periodic_rl/callbacks/record.py",
        old="if group.logprobs and group.logprobs[i] else None\n",
        new="if False else None\n",
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: the loss mask ignores mask_truncated_completions",
        file="src/periodic_rl/callbacks/record.py",
        old="completion_keep([group]) if masked else",
        new="",
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: a resumed run starts a record of its own",
        file="src/periodic_rl/callbacks/record.py",
        old='            self.resolved = Path(state_dict["dirpath"])\n',
        new="            pass\n",
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: a file is written in place, not moved into place whole",
        file="src/periodic_rl/callbacks/record.py",
        old="    with atomic_file(path) as tmp:\n        pq.write_table(table, tmp)\n",
        new="    pq.write_table(table, path)\n",
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: the gradient digest of a step is not kept",
        file="src/periodic_rl/callbacks/record.py",
        old="        self._digests.append(gradient_digest(pl_module))\n",
        new="        pass\n",
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: the trainer's log-probs are dropped",
        file="src/periodic_rl/callbacks/record.py",
        old='"trainer_logprobs": trainer[i] if trainer else None,',
        new='"trainer_logprobs": None,',
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="record: the loss mask ignores the environment tokens of a trajectory",
        file="src/periodic_rl/callbacks/record.py",
        old='"loss_mask": [int(keep[i]) * m for m in mask],',
        new='"loss_mask": [int(keep[i])] * len(ids),',
        tests=("tests/callbacks/test_rollout_record.py",),
    ),
    Mutation(
        name="replay: a multi-turn group is replayed without the record's trajectories",
        file="src/periodic_rl/provenance/replay.py",
        old="                generated.trajectories = list(found)\n",
        new="                pass\n",
        tests=("tests/provenance/test_replay.py::test_replay_rebuilds_a_multi_turn_iteration",),
    ),
    Mutation(
        name="replay: the digest difference is normalised by a huge scale",
        file="src/periodic_rl/provenance/replay.py",
        old="            norm = max(math.sqrt(squares), 1e-30)\n",
        new="            norm = 1e30\n",
        tests=("tests/provenance/test_replay.py",),
    ),
    Mutation(
        name="replay: the digest tolerance is ignored",
        file="src/periodic_rl/provenance/replay.py",
        old="return self.digest_difference <= self.digest_tolerance and not",
        new="return not",
        tests=("tests/provenance/test_replay.py",),
    ),
    Mutation(
        name="replay: tokens over the tolerance are not reported",
        file="src/periodic_rl/provenance/replay.py",
        old="            if abs(value - behaviour) > token_tolerance:\n",
        new="            if False:\n",
        tests=("tests/provenance/test_replay.py",),
    ),
    Mutation(
        name="verify: the parameter tolerance is ignored",
        file="src/periodic_rl/provenance/verify.py",
        old="        return not self.differing_groups and self.max_difference <= self.tolerance\n",
        new="        return not self.differing_groups\n",
        tests=("tests/provenance/test_verify.py",),
    ),
    Mutation(
        name="verify: a group trained in one run only is not a difference",
        file="src/periodic_rl/provenance/verify.py",
        old='verdict.differing_groups.append((i, index, "trained in one run only"))',
        new="pass",
        tests=("tests/provenance/test_verify.py",),
    ),
]
