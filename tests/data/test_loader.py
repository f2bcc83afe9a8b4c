"""PromptLoader shards each iteration's prompts over the ranks, seeded and resumable."""

import pytest

from periodic_rl.data.loader import PromptLoader

ROWS = [{"prompt": f"p{i}"} for i in range(20)]


def batches(loader: PromptLoader, count: int) -> list[list[str]]:
    out, iterator = [], iter(loader)
    for _ in range(count):
        out.append([row["prompt"] for row in next(iterator)])
    return out


def test_rank_slices_in_rank_order_are_the_one_rank_batch():
    one = PromptLoader(ROWS, batch_size=6, seed=3, shuffle=True)
    ranks = [PromptLoader(ROWS, 3, 3, True, rank=r, world_size=2) for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 3
    expected = batches(one, 3)
    per_rank = [batches(loader, 3) for loader in ranks]
    assert [a + b for a, b in zip(*per_rank, strict=True)] == expected
    assert not set(per_rank[0][0]) & set(per_rank[1][0])  # distinct prompts


def test_resumed_rank_continues_where_it_stopped():
    loader = PromptLoader(ROWS, 3, 0, True, rank=1, world_size=2)
    first = batches(loader, 2)
    resumed = PromptLoader(ROWS, 3, 0, True, rank=1, world_size=2)
    resumed.load_state_dict(loader.state_dict())
    straight = batches(PromptLoader(ROWS, 3, 0, True, rank=1, world_size=2), 3)
    assert first + batches(resumed, 1) == straight


def test_too_few_rows_for_every_rank_is_refused():
    with pytest.raises(ValueError, match=r"batch_size=8 x 3 rank"):
        PromptLoader(ROWS, 8, 0, True, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank 2"):
        PromptLoader(ROWS, 2, 0, True, rank=2, world_size=2)


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_of_iteration_are_what_iterating_yields_across_epochs(world_size):
    """Bounded staleness asks for later iterations' rows before the loader yields them."""
    for rank in range(world_size):
        loader = PromptLoader(ROWS, 3, 5, True, rank=rank, world_size=world_size)
        per_epoch = len(loader)
        yielded = [rows for _ in range(3) for rows in loader]  # three epochs
        ahead = PromptLoader(ROWS, 3, 5, True, rank=rank, world_size=world_size)
        assert [ahead.rows_of_iteration(i) for i in range(3 * per_epoch)] == yielded
        assert yielded[0] != yielded[per_epoch]  # the epochs are reshuffled
