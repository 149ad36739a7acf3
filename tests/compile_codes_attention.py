"""Compiles vllm_pq_backend.codes_attention's Triton kernels (attention, merge) for sm_90
(no GPU needed) at every head size, bfloat16 (with attention sinks) and float16 (without);
run by tests/test_codes_attention.py in a process of its own, without Triton's interpreter."""

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from vllm_pq_backend import codes_attention as ca
from vllm_pq_backend.layout import NAN_CODE

POINTERS = {"q_ptr": None, "kcb_ptr": None, "vcb_ptr": None, "o_ptr": "fp32", "lse_ptr": "fp32",
            "kv_ptr": "u8", "table_ptr": "i32", "tile_req_ptr": "i32", "tile_row_ptr": "i32",
            "tile_rows_ptr": "i32", "tile_pos_ptr": "i32", "sink_ptr": None, "out_ptr": None, "oc_ptr": "fp32",
            "lsec_ptr": "fp32", "rows_ptr": "i64", "crows_ptr": "i64"}  # None: the activation dtype


def build(name, fn, const, dtype, num_warps, *shape):
    """Compile ``fn`` with ``const`` for sm_90 and print one "compiled" line."""
    sig = {n: "constexpr" if n in const else "*" + (POINTERS[n] or dtype) if n in POINTERS
           else "fp32" if n == "scale_log2" else "i64" if n.endswith("stride") else "i32"
           for n in fn.arg_names}
    kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert kernel.asm["cubin"]
    print("compiled", name, dtype, *shape, flush=True)


for dtype in ("bf16", "fp16"):
    for d, mk, mv in ((64, 32, 32), (128, 64, 32), (128, 64, 16), (256, 128, 128)):
        build("attention", ca._codes_attention_kernel,
              dict(USE_SINKS=dtype == "bf16", WINDOW=128, SLIDING=1024, HEAD_DIM=d, MK=mk, MV=mv,
                   PAGE=128, K_OFF=0,
                   K_TOK=mk, V_OFF=128 * mk, V_SUB=128, CENTROIDS=256, NAN=NAN_CODE, GROUP=4,
                   BLOCK_M=ca.block_m(d), BLOCK_N=ca.BLOCK_N),
              dtype, ca.NUM_WARPS, d, mk, mv)
        build("merge", ca._merge_rows_kernel, dict(HQ=28, HEADS=ca.MERGE_HEADS, HEAD_DIM=d),
              dtype, 4, d)
