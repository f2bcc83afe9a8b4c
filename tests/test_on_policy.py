"""check_on_policy: the version window and the confirmed fingerprint of each group's version."""

import pytest

from periodic_rl import StaleRolloutError
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
