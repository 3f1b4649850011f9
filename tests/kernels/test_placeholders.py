"""fill_placeholders against plain indexing: awkward sizes, repeated sources, out-of-range
pairs skipped."""

import pytest
import torch

from tinyserve.kernels.placeholders import fill_placeholders


@pytest.mark.parametrize("num_ids,num_sampled,n", [(1, 1, 1), (7, 3, 3), (300, 65, 65),
                                                     (1000, 513, 257)])
def test_matches_indexing(num_ids, num_sampled, n):
    g = torch.Generator().manual_seed(num_ids)
    ids = torch.randint(0, 1 << 40, (num_ids,), generator=g)
    sampled = torch.randint(0, 1 << 40, (num_sampled,), generator=g)
    dst = torch.randperm(num_ids, generator=g)[:n]
    src = torch.randint(0, num_sampled, (n,), generator=g)
    want = ids.clone()
    want[dst] = sampled[src]
    fill_placeholders(ids, torch.stack([dst, src]), sampled)
    assert torch.equal(ids, want)


def test_out_of_range_pairs_are_skipped_and_empty_is_a_no_op():
    ids, sampled = torch.arange(5), torch.tensor([10, 11])
    fill_placeholders(ids, torch.tensor([[0, 9, -1, 4], [1, 0, 0, 5]]), sampled)
    assert ids.tolist() == [11, 1, 2, 3, 4]
    fill_placeholders(ids, torch.empty((2, 0), dtype=torch.int64), sampled)
    assert ids.tolist() == [11, 1, 2, 3, 4]
