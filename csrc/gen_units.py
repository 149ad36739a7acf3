"""Write one translation unit per (dtype, head_dim) instantiating the decode kernel for
the three M it supports, so that ninja (or CI's nvcc check) compiles them in parallel.

    python csrc/gen_units.py OUT_DIR    -> OUT_DIR/pq_decode_<dtype>_d<D>.cu
"""

import os
import sys

DTYPES = {"bf16": "__nv_bfloat16", "f16": "__half"}
HEAD_DIMS = (64, 128, 256)


def units(out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for tag, ctype in DTYPES.items():
        for d in HEAD_DIMS:
            path = os.path.join(out_dir, f"pq_decode_{tag}_d{d}.cu")
            body = '#include "pq_decode.cuh"\nnamespace pq {\n' + "".join(
                f"template cudaError_t launch_decode<{ctype}, {d}, {m}>(const DecodeArgs&, cudaStream_t);\n"
                for m in (d // 8, d // 4, d // 2)
            ) + "}  // namespace pq\n"
            if not os.path.exists(path) or open(path).read() != body:
                with open(path, "w") as f:
                    f.write(body)
            paths.append(path)
    return paths


if __name__ == "__main__":
    print("\n".join(units(sys.argv[1])))
