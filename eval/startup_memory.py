"""Where CUSTOM's engine start-up spends GPU memory: an `LLM` with the CUDA kernels on
Llama-3-8B's shape (dummy weights, random 4-bit codebooks, eager), logging PyTorch's
allocator picture (device free memory, reserved / allocated / inactive-split bytes, retries
and OOMs, cudaMalloc count, oversize allocations and segments) before and after each
codebook's grid build (vllm_pq_backend/nearest.py), all of which run in vLLM's profiling
pass. Lines start with [diag]; the rest is vLLM's own log.

    python eval/startup_memory.py > startup.log 2>&1
"""

import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the hook applies
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_e2e import make_model_dir  # noqa: E402

from vllm_pq_backend import nearest  # noqa: E402


def pic() -> str:
    f, _ = torch.cuda.mem_get_info()
    s = torch.cuda.memory_stats()
    return (f"free {f/2**30:.2f} GiB reserved {s.get('reserved_bytes.all.current',0)/2**30:.2f} "
            f"alloc {s.get('allocated_bytes.all.current',0)/2**30:.2f} inactive_split {s.get('inactive_split_bytes.all.current',0)/2**30:.2f} "
            f"retries {s.get('num_alloc_retries')} ooms {s.get('num_ooms')} device_allocs {s.get('num_device_alloc')} "
            f"oversize_cur {s.get('oversize_allocations.current')} oversize_seg {s.get('oversize_segments.current')}")


def main() -> None:
    orig, calls = nearest.build, [0]

    def build(cb):
        calls[0] += 1
        t0, before = time.time(), pic()
        out = orig(cb)
        if calls[0] <= 8 or calls[0] % 8 == 0:
            print(f"[diag] build#{calls[0]} {tuple(cb.shape)} {time.time()-t0:.2f}s | before {before} | after {pic()}",
                  flush=True)
        return out

    nearest.build = build
    from vllm import LLM

    d = make_model_dir(64)
    t = time.time()
    LLM(model=d, load_format="dummy", max_model_len=33088, attention_backend="CUSTOM",
        additional_config={"pq": {"m": 64}}, enforce_eager=True, gpu_memory_utilization=0.9,
        skip_tokenizer_init=True, max_num_seqs=256, disable_log_stats=True)
    print(f"[diag] engine ready in {time.time()-t:.0f} s; {pic()}", flush=True)


if __name__ == "__main__":
    main()
