"""The custom ops' Python side (vllm_pq_backend/cuda_ops.py) against their C++ schemas:
one typed wrapper and one fake per op, and the fallbacks' signatures match the wrappers'.
The fakes' shapes under FakeTensorMode need the built extension (a GPU)."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from vllm_pq_backend import cuda_ops, fallback
from vllm_pq_backend.layout import PageLayout

BINDING = Path(__file__).resolve().parent.parent / "csrc" / "pq_binding.cpp"


def schema_names() -> list[str]:
    return sorted(re.findall(r'm\.def\(\s*"(\w+)\(', BINDING.read_text()))


def test_every_op_has_one_wrapper_and_a_fake():
    names = schema_names()
    assert len(names) == 7, names
    assert sorted(cuda_ops._FAKES) == names
    called = re.findall(r"torch\.ops\.pq_backend\.(\w+)\(", inspect.getsource(cuda_ops))
    assert sorted(called) == names  # each op called from one place: its wrapper


@pytest.mark.parametrize("name", ["store", "window_write", "dequant_pages", "own_subpages",
                                  "map_rows"])
def test_fallbacks_take_the_wrappers_arguments(name):
    """The layer's ops are cuda_ops or fallback (impl.LayerState.ops): same calls."""
    want = inspect.signature(getattr(cuda_ops, name))
    got = inspect.signature(getattr(fallback, name))
    assert list(got.parameters) == list(want.parameters)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fakes_give_the_ops_output_shapes():
    """Every wrapper runs under fake tensors (torch.compile's tracing): dequant_pages gives
    [pages + extra, B, Hkv, D] in the codebooks' dtype, decode_books a uint8 matrix, the
    others nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert cuda_ops.available()
    lay = PageLayout(64, 32, 16)
    with FakeTensorMode(shape_env=ShapeEnv()):
        dev, bf16 = "cuda", torch.bfloat16
        cache = torch.empty(6, 2, 64, lay.state_bytes, dtype=torch.uint8, device=dev)
        k_cb = torch.empty(2, 32, 256, 2, dtype=bf16, device=dev)
        v_cb = torch.empty(2, 16, 256, 4, dtype=bf16, device=dev)
        ids = torch.zeros(3, dtype=torch.int32, device=dev)
        k, v = cuda_ops.dequant_pages(cache, ids, None, k_cb, v_cb, 2, lay)
        assert k.shape == v.shape == (5, 64, 2, 64) and k.dtype == bf16
        books = cuda_ops.decode_books(k_cb, v_cb)
        assert books.dtype == torch.uint8 and books.dim() == 2
        rows = torch.empty(8, 2, 64, dtype=bf16, device=dev)
        slots = torch.zeros(8, dtype=torch.long, device=dev)
        none = torch.empty(0, dtype=torch.uint8, device=dev)
        assert cuda_ops.store(cache, rows, rows, slots, k_cb.float(), v_cb.float(), none, none,
                              lay) is None
        win = torch.empty(4, 2, 64, 64, dtype=bf16, device=dev)
        assert cuda_ops.window_write(win, win.clone(), rows, rows, slots, slots, slots) is None
        pages = torch.empty(10, 2, 64, dtype=bf16, device=dev)
        assert cuda_ops.own_subpages(pages, pages.clone(), 2, rows, rows, slots) is None
        t = torch.empty(2, 64, 64, device=dev)
        assert cuda_ops.map_rows([rows.clone()], [rows], [t]) is None
        q = torch.empty(3, 4, 64, dtype=bf16, device=dev)
        seq = torch.zeros(3, dtype=torch.int32, device=dev)
        table = torch.zeros(3, 4, dtype=torch.int32, device=dev)
        ws = torch.empty(1000, device=dev)
        assert cuda_ops.decode(
            torch.empty_like(q), q, cache, table, seq, seq, k_cb, v_cb, books, win, win.clone(),
            seq, rows[:3], rows[:3], window=64, sliding_window=0, num_splits=2, min_split=256,
            num_ctas=4, scale=0.125, sinks=torch.zeros(4, device=dev), lut=False, ws_o=ws,
            ws_lse=ws.clone(), corr=ws.new_empty(0), corr_slots=0, layout=lay) is None
