"""eval/accuracy_sim.py's --exact reads: each keeps exactly the part of K or V it names,
chosen as it says, and a malformed spec is one clear error."""

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from accuracy_sim import exact_spec, keep_exact  # noqa: E402

T, H, D = 40, 3, 8


@pytest.fixture
def pair():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, D, generator=g)
    xq = x + 0.1 * torch.randn(T, H, D, generator=g) * torch.rand(T, H, 1, generator=g)
    return x, xq


def exact_mask(x, xq, out):
    assert torch.all((out == x) | (out == xq)), "every element is either exact or as coded"
    return (out == x) & (x != xq)


def test_rows_keeps_the_rows_that_err_most_per_head(pair):
    x, xq = pair
    out = keep_exact("rows", 0.1, x, xq)
    kept = exact_mask(x, xq, out).all(-1)  # [T, H]
    n = math.ceil(0.1 * T)
    err = ((x - xq) ** 2).sum(-1) / (x * x).sum(-1)
    for h in range(H):
        assert int(kept[:, h].sum()) == n
        assert not kept[0, h], "position 0 is pinned already"
        want = set(err[1:, h].topk(n).indices.add(1).tolist())
        assert set(kept[:, h].nonzero()[:, 0].tolist()) == want
    assert torch.equal(exact_mask(x, xq, out).any(-1), kept), "whole rows, nothing else"


def test_elems_keeps_the_elements_that_err_most_per_head(pair):
    x, xq = pair
    out = keep_exact("elems", 0.05, x, xq)
    kept = exact_mask(x, xq, out)
    n = math.ceil(0.05 * T * D)
    err = (x - xq).abs()
    for h in range(H):
        assert int(kept[:, h].sum()) == n
        assert err[:, h][kept[:, h]].min() >= err[:, h][~kept[:, h]].max()


def test_vec_keeps_a_fixed_count_in_every_vector(pair):
    x, xq = pair
    out = keep_exact("vec", 2, x, xq)
    kept = exact_mask(x, xq, out)
    assert torch.all(kept.sum(-1) == 2)
    err = (x - xq).abs()
    assert torch.all(err.masked_fill(~kept, math.inf).amin(-1) >= err.masked_fill(kept, -1).amax(-1))


def test_mass_keeps_the_keys_that_draw_the_most_attention(pair):
    x, xq = pair
    mass = torch.rand(H, T, generator=torch.Generator().manual_seed(1))
    mass[:, 0] = 10.0  # BOS draws the most, and is pinned already
    out = keep_exact("mass", 5, x, xq, mass)
    kept = exact_mask(x, xq, out).all(-1)
    for h in range(H):
        assert set(kept[:, h].nonzero()[:, 0].tolist()) == set(mass[h, 1:].topk(5).indices.add(1).tolist())


def test_first_keeps_the_first_positions_after_bos(pair):
    x, xq = pair
    out = keep_exact("first", 4, x, xq)
    assert torch.equal(out[1:5], x[1:5])
    assert torch.equal(out[0], xq[0]) and torch.equal(out[5:], xq[5:])


@pytest.mark.parametrize("spec", ["rows:0", "rows:1", "elems:2", "vec:0", "vec:1.5", "page:0", "mass:x",
                                  "first:-3", "heavy:4", "rows"])
def test_a_malformed_spec_is_refused(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="expected rows:F"):
        exact_spec(spec)


def test_specs_parse():
    assert exact_spec("rows:0.01") == ("rows", 0.01)
    assert exact_spec("vec:2") == ("vec", 2.0)
    assert exact_spec("page:1") == ("page", 1.0)
    assert exact_spec("first:16") == ("first", 16.0)


def test_page_keeps_the_rows_that_err_most_in_every_block(pair, monkeypatch):
    import accuracy_sim

    monkeypatch.setattr(accuracy_sim, "PAGE", 16)
    x, xq = pair
    out = keep_exact("page", 2, x, xq)
    kept = exact_mask(x, xq, out).all(-1)
    err = ((x - xq) ** 2).sum(-1) / (x * x).sum(-1)
    err[0] = -1
    for h in range(H):
        for lo in range(0, T, 16):
            blk = err[lo : lo + 16, h]
            want = set((blk.topk(2).indices + lo).tolist())
            assert set(kept[lo : lo + 16, h].nonzero()[:, 0].add(lo).tolist()) == want


def test_v_from_specs_parse():
    from accuracy_sim import v_from_spec

    assert v_from_spec("dir/b4.safetensors@18-23") == [("dir/b4.safetensors", list(range(18, 24)))]
    assert v_from_spec("a@b.safetensors@3,0-1,3") == [("a@b.safetensors", [0, 1, 3])]
    assert v_from_spec("b4@18-23+b1@0-1") == [("b4", list(range(18, 24))), ("b1", [0, 1])]


@pytest.mark.parametrize("spec", ["b4.safetensors", "b4.safetensors@", "@1-2", "b4@x-3", "b4@1+"])
def test_a_malformed_v_from_is_refused(spec):
    from accuracy_sim import v_from_spec

    with pytest.raises(argparse.ArgumentTypeError, match="PATH@LAYERS"):
        v_from_spec(spec)
