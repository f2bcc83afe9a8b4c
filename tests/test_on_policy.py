"""check_on_policy: the version window and the confirmed fingerprint of each group's version;
through RLModule, every micro-batch of an iteration is checked."""

from dataclasses import replace

import pytest
from rl_helpers import RecordingModule, train

from periodic_rl import PeriodicAsyncStrategy, StaleRolloutError
from periodic_rl.on_policy import check_on_policy
from periodic_rl.rollout.types import RolloutGroup

CONFIRMED = {3: "fp3", 4: "fp4", 5: "fp5"}


def group(version: int, fingerprint: str) -> RolloutGroup:
    return RolloutGroup(
        index=0, prompt=None, prompt_ids=[], completion_ids=[], completions=[],
        version=version, fingerprint=fingerprint,
    )  # fmt: skip


def test_on_policy_accepts_only_the_current_version_and_its_fingerprint():
    check_on_policy([group(5, "fp5")], 5, "fp5")
    for bad in (group(4, "fp4"), group(5, "fp4"), group(6, "fp5")):
        with pytest.raises(StaleRolloutError, match="refusing an off-policy rollout"):
            check_on_policy([bad], 5, "fp5")


def test_bounded_staleness_accepts_k_versions_back_with_their_own_fingerprints():
    check_on_policy([group(5, "fp5"), group(4, "fp4")], 5, CONFIRMED.get, max_staleness=1)
    with pytest.raises(StaleRolloutError, match=r"versions 4\.\.5 \(max_staleness\)"):
        check_on_policy([group(3, "fp3")], 5, CONFIRMED.get, max_staleness=1)  # too old
    with pytest.raises(StaleRolloutError, match="version 4"):
        check_on_policy([group(4, "fp5")], 5, CONFIRMED.get, max_staleness=1)  # other weights
    with pytest.raises(StaleRolloutError):
        check_on_policy([group(6, "fp6")], 5, CONFIRMED.get, max_staleness=2)  # from the future


def test_every_version_a_partial_rollout_carries_is_checked():
    """A group continued under newer weights (partial rollouts) carries each version that drew
    its tokens: each must be inside the window, with its own confirmed fingerprint."""
    spanning = replace(group(4, "fp4"), version_fingerprints={4: "fp4", 5: "fp5"})
    check_on_policy([spanning], 5, CONFIRMED.get, max_staleness=1)
    lying = replace(spanning, version_fingerprints={4: "fp4", 5: "fp4"})
    with pytest.raises(StaleRolloutError, match="version 5 .fingerprint fp4"):
        check_on_policy([lying], 5, CONFIRMED.get, max_staleness=1)
    future = replace(spanning, version_fingerprints={4: "fp4", 6: "fp6"})
    with pytest.raises(StaleRolloutError, match="version 6"):
        check_on_policy([future], 5, {**CONFIRMED, 6: "fp6"}.get, max_staleness=1)


# ---- through RLModule: every micro-batch is checked, not only the first ------------------------
class _LaterMicroBatchFromOtherWeights(PeriodicAsyncStrategy):
    """Stamps the first group of the iteration's second micro-batch with weights the engines
    never confirmed (as a push that silently failed mid-iteration would)."""

    def rollout_micro_batches(self, request, micro_batch_size, ahead=()):
        inner = super().rollout_micro_batches(request, micro_batch_size, ahead)
        try:
            for n, groups in enumerate(inner):
                if n == 1:
                    groups = [replace(groups[0], fingerprint="other-weights"), *groups[1:]]
                yield groups
        finally:
            inner.close()


class _RecordsBackwards(RecordingModule):
    """Appends the group indices of each back-propagated micro-batch to ``trained`` (a list
    the test owns: the module is built inside ``train``)."""

    trained: list[list[int]] = []

    def _backward_micro_batch(self, groups, first=None):
        self.trained.append([g.index for g in groups])
        return super()._backward_micro_batch(groups, first)


def test_a_bad_group_in_a_later_micro_batch_is_refused(tiny_llama_path):
    """Two micro-batches of one group each: the first trains, the second carries a group of
    unconfirmed weights and stops the iteration before its backward."""
    module_cls = type("Records", (_RecordsBackwards,), {"trained": []})
    with pytest.raises(StaleRolloutError, match="fingerprint other-weigh.*refusing") as caught:
        train(
            tiny_llama_path,
            steps=1,
            batch_size=2,
            micro_batch_size=4,  # one group of 4 per micro-batch
            module_cls=module_cls,
            strategy_cls=_LaterMicroBatchFromOtherWeights,
        )
    assert "policy is version 0" in str(caught.value)
    assert len(module_cls.trained) == 1  # the first micro-batch trained, the second was refused
