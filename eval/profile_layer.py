"""CPU and GPU time of one attention layer's calls on the GPU (CUSTOM: forward, which
stores the step's K/V itself; FLASH_ATTN: its KV-cache update, then forward), CUSTOM
against FLASH_ATTN on the same batch: what an eager step (one that carries a prefill,
which vLLM runs outside its full CUDA graphs) costs per layer.

    python eval/profile_layer.py [BITS] [PROMPT_TOKENS] [maps]     # defaults: 4 1024

Llama-3-8B's layer shape (32 query / 8 KV heads, head_dim 128, block 128, window 128),
random codebooks (with ``maps``: random K and V maps too, as calibration writes them by
default, so that the query / key / value / output maps run as with real codebooks),
through tests/helpers.Sim (the backend driven as vLLM's model runner
drives it). Eight requests hold 1000 tokens each; then two batches are measured:

- mixed: the eight decode one token each and a new request prefills PROMPT_TOKENS;
- decode only: the eight decode (in serving these steps replay a CUDA graph, so their
  CPU time is paid at capture only).

For each, the layer's calls are issued 50 times back to back after warm-up: "layer CPU"
is the host time per call, "GPU" the CUDA-event time per call over the same loop (equal
to the CPU time when the GPU waits for the host); then a torch.profiler table of 10 calls
(ops by self CPU time: their counts are per 10 layers) and FLASH_ATTN's impl and metadata
builder on the same CommonAttentionMetadata and q/k/v (vLLM's own classes).
"""

import json
import os
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from helpers import Sim, random_codebooks, vllm_config, write_model_config  # noqa: E402
from provenance import provenance  # noqa: E402

from vllm_pq_backend.config import default_codebook_path  # noqa: E402

DEV = "cuda"
ITERS = 50


def main() -> None:
    bits = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    maps = sys.argv[3:4] == ["maps"]
    print(json.dumps(provenance()))
    d = tempfile.mkdtemp()
    write_model_config(d, head_dim=128, q_heads=32, kv_heads=8, layers=1)
    m = bits * 128 // 8
    random_codebooks(default_codebook_path(d, m, m), d, m, seed=1, m_v=m, transforms=maps)
    vc = vllm_config(d, block_size=128, pq={"m": m, "m_v": m}, max_num_seqs=16,
                     max_model_len=4096)
    sim = Sim(vc, num_blocks=256, dtype=torch.bfloat16, device=DEV)
    # the arguments of the last forward / metadata build, to replay them
    rec = {}
    impl, builder = sim.impl, sim.builder
    forward, build = impl.forward, builder.build

    def recorder(name, fn):
        def call(*a, **k):
            rec[name] = (a, k)
            return fn(*a, **k)
        return call

    impl.forward = recorder("forward", forward)
    builder.build = recorder("build", build)
    for rid in range(8):
        sim.add(rid, max_len=1300)
        sim.step([(rid, 1000)])
    sim.add(8, max_len=1300)
    for _ in range(3):
        sim.step([(r, 1) for r in range(8)])

    def timed(layer):
        for _ in range(3):
            layer()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            layer()
        cpu = (time.perf_counter() - t0) / ITERS
        e1.record()
        torch.cuda.synchronize()
        return cpu * 1e6, e0.elapsed_time(e1) / ITERS * 1e3

    def measure(name, work):
        sim.step(work)
        fa, fk = rec["forward"]

        def layer():
            forward(*fa, **fk)

        cpu, gpu = timed(layer)
        print(f"{name}: layer CPU {cpu:.0f} us, GPU {gpu:.0f} us")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                layer()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        cpu, gpu = timed(flash_attn_layer(vc, rec["build"][0][1], *fa[1:4]))
        print(f"  FLASH_ATTN same batch: layer CPU {cpu:.0f} us, GPU {gpu:.0f} us")

    what = f"{bits} bits" + (", with maps" if maps else "")
    measure(f"mixed 8 decodes + {prompt} prefill, {what}", [(r, 1) for r in range(8)] + [(8, prompt)])
    measure(f"decode only 8, {what}", [(r, 1) for r in range(8)])


def flash_attn_layer(vc, cam, q, k, v):
    """FLASH_ATTN's store + forward of one layer on the same batch."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    with set_current_vllm_config(vc):
        spec = FullAttentionSpec(block_size=128, num_kv_heads=8, head_size=128,
                                 dtype=torch.bfloat16)
        builder = FlashAttentionBackend.get_builder_cls()(spec, ["layer"], vc, torch.device(DEV))
        impl = FlashAttentionBackend.get_impl_cls()(32, 128, 128**-0.5, 8, None, None, "auto")
    md = builder.build(0, cam)
    cache = torch.zeros(256, 8, 128, 256, dtype=torch.bfloat16, device=DEV)  # (B, H, N, 2 * D)
    one = torch.ones((), device=DEV)
    layer = types.SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one, _q_scale_float=1.0,
                                  _k_scale_float=1.0, _v_scale_float=1.0,
                                  layer_name="model.layers.0.self_attn.attn")
    out = torch.empty_like(q)

    def run():
        impl.do_kv_cache_update(layer, k, v, cache, cam.slot_mapping)
        impl.forward(layer, q, k, v, cache, md, out)

    return run


if __name__ == "__main__":
    main()
