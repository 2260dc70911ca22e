import pytest

from areal_ray.algo.microbatch import count_microbatches, split_balanced


@pytest.mark.parametrize("lengths,budget,expected", [
    ([10, 10, 10], 100, 1), ([60, 60, 60], 100, 2), ([150], 100, 2), ([], 100, 0)])
def test_count(lengths, budget, expected):
    assert count_microbatches(lengths, budget) == expected


def test_split_balanced_uses_every_index_once_and_balances():
    lengths = [90, 10, 50, 50, 40, 60, 5, 95]
    bins = split_balanced(lengths, 3)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths)
    assert all(bins)


def test_split_errors():
    with pytest.raises(ValueError):
        split_balanced([1, 2], 3)
    with pytest.raises(ValueError):
        split_balanced([1], 0)
