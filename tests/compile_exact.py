"""Compiles vllm_pq_backend.exact's Triton kernels for sm_90 (no GPU needed) at every head
size, bfloat16 and float16: Triton's interpreter (the CPU tests) accepts programs the
compiler refuses. Run by tests/test_exact.py in a process of its own."""

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from vllm_pq_backend import exact
from vllm_pq_backend.layout import PageLayout

POINTERS = {"kv_ptr": "u8", "x_ptr": None, "cb_ptr": "fp32", "slot_ptr": "i64", "out_ptr": None,
            "ids_ptr": "i32", "first_ptr": "i64", "corr_ptr": "fp32", "q_ptr": None,
            "table_ptr": "i32", "seq_ptr": "i32", "kcb_ptr": None, "vcb_ptr": None}
FLOATS = ("tiny", "scale_log2")
WIDE = ("block_stride", "head_stride", "x_row", "q_row", "table_stride")


def build(name, fn, const, dtype):
    sig = {n: "constexpr" if n in const else "*" + (POINTERS[n] or dtype) if n in POINTERS
           else "fp32" if n in FLOATS else "i64" if n in WIDE else "i32" for n in fn.arg_names}
    kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"]
    print("compiled", name, dtype, *const.values(), flush=True)


for dtype in ("bf16", "fp16"):
    for d, mk, mv, p in ((64, 32, 16, 2), (128, 64, 64, 1), (256, 128, 64, 4)):
        lay = PageLayout(128, mk, mv, d, p)
        for which, m in ((0, mk), (1, mv)):
            entries = exact._entries(lay, which)
            build("update", exact._update_kernel, dict(entries, **exact._codes(lay, which), M=m,
                                                       DC=min(exact.DIMS, d)), dtype)
            build("pages", exact._pages_kernel, dict(entries, HAS_FIRST=which == 0), dtype)
        build("decode", exact._decode_kernel, dict(
            G=4, G_PAD=4, MK=mk, MV=mv, V_OFF=lay.v_offset, RES_K=lay.residual_offset(0),
            RES_V=lay.residual_offset(1), ERR_K=lay.error_offset(0), ERR_V=lay.error_offset(1),
            IDX_K=lay.index_offset(0), IDX_V=lay.index_offset(1), D=d, B=128, P=p,
            P_PAD=exact.triton.next_power_of_2(p)), dtype)
