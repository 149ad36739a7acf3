"""The store's grid records (nearest.py), on the CPU: every centroid that can be nearest to a
point, within rounding, is in the list of the point's cell, as the kernel finds the cell."""

import pytest
import torch

from vllm_pq_backend import codebooks, nearest


def parse(rec):
    head = rec[:16].view(torch.float32)
    bins_at, off_at, lists_at, fine, cells = rec[16:26].view(torch.int16).tolist()
    bins = rec[bins_at:bins_at + 2 * fine].view(2, fine).long()
    offs = rec[off_at:lists_at].view(torch.int16).long()
    return head[:2], head[2:], bins, offs, rec[lists_at:].long(), fine, cells


def books(seed, heads=1, m=4):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.where(torch.rand(heads, m, 256, 1, generator=gen) < 0.7, 0.3, 1.5)
    return codebooks.nan_marked(torch.randn(heads, m, 256, 2, generator=gen) * scale), gen


@pytest.mark.parametrize("seed", [0, 1])
def test_cells_list_every_centroid_that_can_be_nearest(seed):
    cb, gen = books(seed)
    rec = nearest.build(cb)
    assert rec.dtype == torch.uint8 and rec.shape[:2] == cb.shape[:2]
    assert rec.shape[2] % 16 == 0 and rec.shape[2] <= nearest.MAX_RECORD
    lengths = []
    for s in range(cb.shape[1]):
        c = cb[0, s]
        lo, inv_w, bins, offs, lists, fine, cells = parse(rec[0, s])
        assert (offs[1:] >= offs[:-1]).all()
        ok = torch.isfinite(c).all(1).nonzero().squeeze(1)
        n = 3000
        j = ok[torch.randint(0, len(ok), (n,), generator=gen)]
        x = c[j] + 0.15 * torch.randn(n, 2, generator=gen)
        x[:300] = c[j[:300]]  # on centroids
        x[300:600] = (c[j[300:600]] + c[ok[torch.randint(0, len(ok), (300,), generator=gen)]]) / 2
        x[600:900] = lo + torch.randint(0, fine + 1, (300, 2), generator=gen) / inv_w  # bin edges
        x = x.to(torch.bfloat16).float()  # what the kernel reads
        f = ((x - lo) * inv_w).floor()  # the kernel's fp32 arithmetic
        inside = ((f >= 0) & (f < fine)).all(1)
        assert inside.float().mean() > 0.99
        fi = f[inside].long()
        cell = bins[0][fi[:, 0]] * cells + bins[1][fi[:, 1]]
        d = ((x[inside, None].double() - c[None].double()) ** 2).sum(-1)
        d = torch.where(d.isnan(), float("inf"), d)
        scale = x[inside].double().square().sum(1, keepdim=True) + c.double().square().sum(1).nan_to_num(0)
        close = d <= d.min(1, keepdim=True).values + 1e-6 * scale  # nearest, or tied within rounding
        for i in range(len(cell)):
            listed = lists[offs[cell[i]]:offs[cell[i] + 1]]
            assert (listed[1:] > listed[:-1]).all()  # index order: the first minimum wins
            assert 255 not in listed.tolist() or s != 0  # the NaN marker is never listed
            assert set(close[i].nonzero().squeeze(1).tolist()) <= set(listed.tolist()), i
            lengths.append(len(listed))
    # the point of it: a few centroids per token instead of 256
    assert sum(lengths) / len(lengths) < 16


def test_only_two_dimensional_subspaces_get_records():
    cb = torch.randn(2, 4, 256, 4)
    assert nearest.build(cb).numel() == 0
    cb, _ = books(3, heads=2, m=3)
    rec = nearest.build(cb)
    assert rec.shape[:2] == (2, 3)
    bins_at, off_at, lists_at = nearest.sections()
    assert rec[0, 0, 16:22].view(torch.int16).tolist() == [bins_at, off_at, lists_at]
