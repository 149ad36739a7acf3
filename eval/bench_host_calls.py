"""What calling an op costs the host, apart from the op's own work: the backend's ops
(their schemas read from csrc/pq_binding.cpp's TORCH_LIBRARY block, so they are the real
ones) registered again under a namespace of their own with a C++ kernel that does nothing,
called through ``torch.ops`` as the backend calls them, against the same arguments passed
to a C++ function bound directly with pybind11, and a few Python costs for scale (a call
of a Python function with the same arguments, a tensor slice, ``new_empty``).

In a step that carries a prompt vLLM runs attention eagerly, and CUSTOM's layer is
host-bound there (eval/results/steps.json: 0.5 ms a layer on the host against
FLASH_ATTN's 0.16); this says how much of a layer's host time is the calls themselves.
Needs no GPU (CPU tensors; a CPU build of torch is enough, plus g++ and ninja), and says so
in its result: the CPU is this machine's, not a GPU server's.

    python eval/bench_host_calls.py --out eval/results/host_calls.json
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BINDING = os.path.join(HERE, "..", "csrc", "pq_binding.cpp")
NS = "pq_host_bench"

# A boxed kernel that accepts any schema: drops the arguments, returns empty tensors.
# Calls from Python box their arguments anyway, so this pays everything a real kernel's
# call does except the unboxing into C++ parameters and the kernel's own checks.
NOOP_CPP = r"""
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

namespace {
void noop(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  torch::jit::drop(*stack, schema.arguments().size());
  for (size_t i = 0; i < schema.returns().size(); ++i) stack->emplace_back(at::empty({0}));
}
}  // namespace

TORCH_LIBRARY_IMPL(NS, CPU, m) {
IMPLS}
"""

# The decode op's arguments as C++ parameters, bound with pybind11 (the same 28 values).
DIRECT_CPP = r"""
#include <torch/extension.h>

void decode_direct(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& order,
                   const at::Tensor& k_cb, const at::Tensor& v_cb, const at::Tensor& books, at::Tensor win_k, at::Tensor win_v,
                   const at::Tensor& rows, const at::Tensor& new_k, const at::Tensor& new_v, int64_t window,
                   int64_t sliding_window, int64_t num_splits, int64_t min_split, int64_t num_ctas,
                   double scale, bool lut, at::Tensor ws_o, at::Tensor ws_lse, int64_t k_off, int64_t k_tok,
                   int64_t v_off, int64_t v_sub, int64_t nan_code) {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode", &decode_direct); }
"""


def schemas(path: str = BINDING) -> dict[str, str]:
    """name -> schema of every op the binding defines (its m.def string literals joined)."""
    src = open(path).read()
    block = src[src.index("TORCH_LIBRARY(pq_backend"):]
    block = block[: block.index("\n}\n")]
    out = {}
    for call in re.findall(r"m\.def\(((?:\s*\"[^\"]*\")+)\s*\)", block):
        schema = "".join(re.findall(r"\"([^\"]*)\"", call))
        out[schema[: schema.index("(")]] = schema
    return out


def build(ops: dict[str, str]):
    """Registers ``ops`` (name -> schema) under NS with the no-op kernel; returns the
    Library (the definitions last as long as it does) and the pybind11 module."""
    from torch.utils.cpp_extension import load_inline

    lib = torch.library.Library(NS, "DEF")
    for schema in ops.values():
        lib.define(schema)
    impls = "".join(f'  m.impl("{name}", torch::CppFunction::makeFromBoxedFunction<&noop>());\n'
                    for name in ops)
    load_inline(f"{NS}_noop", cpp_sources=NOOP_CPP.replace("NS", NS).replace("IMPLS", impls),
                is_python_module=False, extra_cflags=["-O2"])
    direct = load_inline(f"{NS}_direct", cpp_sources=DIRECT_CPP, extra_cflags=["-O2"])
    return lib, direct


def arguments():
    """Each op's arguments as the backend passes them (CPU tensors of small shapes: the
    call's cost does not depend on them)."""
    t = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype)  # noqa: E731
    lay = (0, 64, 16 * 64, 16, 255)  # layout.kernel_args(): k_off, k_tok, v_off, v_sub, nan_code
    q, key = t(8, 32, 128), t(8, 8, 128)
    cache = t(64, 8, 16, 128, dtype=torch.uint8)
    cb, win = t(8, 64, 256, 2), t(16, 8, 128, 128)
    ints = lambda n, dtype=torch.int32: torch.zeros(n, dtype=dtype)  # noqa: E731
    decode = (t(8, 32, 128), q, cache, ints((8, 64)), ints(8), ints(8), cb, cb, t(8, 131072, dtype=torch.uint8),
              win, win, ints(8), key, key, 128, 0, 2, 256, 66, 0.088, False, t(1 << 16, dtype=torch.float32),
              t(1 << 12, dtype=torch.float32), *lay)
    return {
        "store": (cache, key, key, ints(8, torch.long), cb.float(), cb.float(), t(8, 64, 64, dtype=torch.uint8),
                  t(8, 64, 64, dtype=torch.uint8), *lay),
        "window_write": (win, win, key, key, ints(8, torch.long), ints(8, torch.long), ints(8, torch.long)),
        "decode": decode,
        "dequant_pages": (cache, ints(64), ints(64, torch.long), cb, cb, 8, *lay),
        "own_subpages": (t(1024, 8, 128), t(1024, 8, 128), 512, key, key, ints(128, torch.long)),
        "map": ([q, key], [q, key], [t(1, 128, 128, dtype=torch.float32)] * 2),
        "decode_books": (cb, cb),
    }


def per_call_us(fn, args, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean host time of ``calls`` calls, in microseconds."""
    for _ in range(calls // 10):
        fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    ops = schemas()
    lib, direct = build(ops)
    known = arguments()
    assert set(ops) <= set(known), f"no arguments for {sorted(set(ops) - set(known))}"
    args = {name: known[name] for name in ops}

    def python_fn(*a):
        return None

    rows = []
    for mode in ("inference_mode", "no_grad"):
        ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with ctx:
            for name in ops:
                op = getattr(getattr(torch.ops, NS), name)
                row = dict(mode=mode, op=name, args=len(args[name]),
                           torch_ops_us=per_call_us(op, args[name], a.calls, a.repeats),
                           python_function_us=per_call_us(python_fn, args[name], a.calls, a.repeats))
                if name == "decode":
                    row["pybind11_us"] = per_call_us(direct.decode, args[name], a.calls, a.repeats)
                print(row, flush=True)
                rows.append(row)
            x = torch.zeros(64, 8, 128)
            for what, fn, fa in (("slice x[:n]", lambda x, n: x[:n], (x, 8)),
                                 ("x.new_empty(0)", lambda x: x.new_empty(0), (x,)),
                                 ("x.view(-1, 8, 128)", lambda x: x.view(-1, 8, 128), (x,))):
                row = dict(mode=mode, op=what, python_us=per_call_us(fn, fa, a.calls, a.repeats))
                print(row, flush=True)
                rows.append(row)
    if a.out:
        from provenance import provenance, write_result

        cpu = platform.processor() or platform.machine()
        try:
            cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                       if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        write_result(a.out, dict(provenance(device=f"CPU only: {cpu}, {os.cpu_count()} cores"),
                                 calls=a.calls, repeats=a.repeats, rows=rows))
    del lib
    return 0


if __name__ == "__main__":
    sys.exit(main())
