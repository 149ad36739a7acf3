"""What a prompt costs the requests already decoding, in vLLM's own engine (compiled, CUDA
graphs, async scheduling, as `vllm serve` runs it): eight requests decode while a
prompt (PROMPT tokens, one output token) joins every 12 engine steps; for each prompt,
the time its 8 steps took beyond the decode-only step time (the median of the last 4
steps of each window) is its "excess". In serving that excess is what a decoding
request's inter-token latency (p99 ITL, and so p99 TPOT) pays per arriving prompt.

    python eval/bench_steps.py MODEL_DIR --out eval/results/steps.json [--bits 4]
        [--backends CUSTOM FLASH_ATTN] [--ablate] [--prompt 1024]

MODEL_DIR: a dummy-weight folder from `eval/random_model.py OUT --dummy --bits 4 2`
(Llama-3-8B's shape). Each backend runs in a process of its own, one after the other on
the same GPU. Besides the step times, each backend's attention forward is timed on the
host in the prompt steps (per layer call); for CUSTOM also its parts (store, decode,
prefill, and within prefill the page dequantization, the segments' own subpages, the
FlashAttention call, the window write).

--ablate (CUSTOM, diagnosis only: the outputs are then wrong) repeats the step times with
parts of the prompt's work taken out: "prefill_fa_only" attends the prompt to its own
keys by one FlashAttention call (what FLASH_ATTN does for a prompt without history: no
dequantized pages, no segments, no window write), "no_prompt_store" skips the store in
prompt steps, and both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DECODERS, EVERY, TAIL = 8, 12, 4  # requests decoding; steps per prompt; decode-only steps


class HostTimer:
    """Host time of wrapped calls made in prompt steps: a call with a ``gate`` is timed when
    the gate says so and makes the calls inside it ``active``; one without is timed when
    active (the forward's parts)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.active = False

    def wrap(self, name, f, gate=None):
        def timed(*args, **kwargs):
            on = self.active if gate is None else gate(*args)
            if not on:
                return f(*args, **kwargs)
            outer, self.active = self.active, True
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1
                self.active = outer

        return timed

    def per_call_us(self) -> dict:
        return {k: round(1e6 * v / self.calls[k], 1) for k, v in self.total.items()}

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


def run_one(a) -> list[dict]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: timers see it
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(os.path.join(a.model, "config.json")))
    kw = dict(model=a.model, load_format="dummy", max_model_len=4096,
              gpu_memory_utilization=0.9, attention_backend=a.one)
    if a.one == "CUSTOM":
        kw["additional_config"] = {"pq": {"m": cfg["head_dim"] * a.bits // 8}}
    engine = LLM(**kw).llm_engine
    rng = np.random.default_rng(0)
    ids = [0]

    def add(n: int, max_tokens: int) -> None:
        ids[0] += 1
        prompt = TokensPrompt(prompt_token_ids=rng.integers(100, 30000, n).tolist())
        engine.add_request(f"r{ids[0]}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    for _ in range(DECODERS):
        add(a.prompt, 4096 - a.prompt - 8)
    for _ in range(20):  # the eight are decoding
        engine.step()

    timer = HostTimer()
    if a.one == "CUSTOM":
        from vllm_pq_backend import codes_attention, ops
        from vllm_pq_backend.impl import PQAttentionImpl as Impl
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as Impl
    # prompt steps: more rows than the decodes (decode steps: their CUDA graphs' size)
    Impl.forward = timer.wrap("forward", Impl.forward,
                              gate=lambda self, layer, query, *rest: query.shape[0] > DECODERS)
    if hasattr(Impl, "do_kv_cache_update"):  # FLASH_ATTN writes its cache apart from forward
        Impl.do_kv_cache_update = timer.wrap(
            "kv_cache_update", Impl.do_kv_cache_update,
            gate=lambda self, layer, key, *rest: key.shape[0] > DECODERS)

    rows = []

    def phase(name: str, per: int = 1, injections: int = 16) -> None:
        dts, marks = [], []
        timer.reset()
        last = time.perf_counter()
        for i in range(injections * EVERY):
            if i % EVERY == 0:
                for _ in range(per):
                    add(a.prompt, 1)
                marks.append(len(dts))
            engine.step()
            now = time.perf_counter()
            dts.append(1e3 * (now - last))
            last = now
        dts = np.array(dts)
        marks = marks[2:]  # the first two windows start from other phases' steps
        base = float(np.median(np.concatenate([dts[m + EVERY - TAIL : m + EVERY] for m in marks])))
        excess = [float(np.sum(dts[m : m + EVERY - TAIL] - base)) for m in marks]
        peak = [float(np.max(dts[m : m + EVERY - TAIL])) for m in marks]
        row = dict(backend=a.one, phase=name, prompts_per_injection=per, prompt_tokens=a.prompt,
                   decoding=DECODERS, injections=len(marks), decode_step_ms=round(base, 3),
                   excess_ms_median=round(float(np.median(excess)), 2),
                   excess_ms_mean=round(float(np.mean(excess)), 2),
                   longest_step_ms_median=round(float(np.median(peak)), 2),
                   host_us_per_layer_call=timer.per_call_us())
        print(json.dumps(row), flush=True)
        rows.append(row)

    phase("warm-up")
    phase("base")
    if a.one == "CUSTOM":
        # the parts' host times (prompt steps only), in a phase of their own
        parts = {"store": (ops, "store"), "decode": (ops, "decode"), "prefill": (ops, "prefill"),
                 "window_write": (ops, "window_write"),
                 "dequant_pages": (codes_attention, "dequant_pages"),
                 "own_subpages": (codes_attention, "own_subpages")}
        saved = {k: getattr(mod, attr) for k, (mod, attr) in parts.items()}
        for k, (mod, attr) in parts.items():
            setattr(mod, attr, timer.wrap(k, saved[k]))
        fa_for = ops.flash_attn_for

        def timed_fa_for(t):
            varlen, version = fa_for(t)
            return timer.wrap("flash_attn", varlen), version

        ops.flash_attn_for = timed_fa_for
        phase("base, parts timed")
        for k, (mod, attr) in parts.items():
            setattr(mod, attr, saved[k])
        ops.flash_attn_for = fa_for
    if a.ablate and a.one == "CUSTOM":
        prefill, store = ops.prefill, ops.store

        def prefill_fa_only(out, query, key, value, kv_cache, md, state, scale):
            varlen, version = ops.flash_attn_for(query)
            for p in md.prefills:
                rows_ = slice(md.num_decode_tokens + p.tok_start, md.num_decode_tokens + p.tok_end)
                varlen(q=query[rows_], k=key[rows_], v=value[rows_], out=out[rows_],
                       cu_seqlens_q=p.cu_q, max_seqlen_q=p.max_q, cu_seqlens_k=p.cu_q,
                       max_seqlen_k=p.max_q, softmax_scale=scale, causal=True,
                       fa_version=version(head_size=query.shape[-1]))

        def store_decodes_only(kv_cache, key, value, slot_mapping, state):
            if key.shape[0] <= DECODERS:
                store(kv_cache, key, value, slot_mapping, state)

        ops.prefill = prefill_fa_only
        phase("ablation: prefill_fa_only")
        ops.store = store_decodes_only
        phase("ablation: prefill_fa_only + no_prompt_store")
        ops.prefill = prefill
        phase("ablation: no_prompt_store")
        ops.store = store
        phase("base (again)")
    phase("two prompts at once", per=2)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--out")
    p.add_argument("--bits", type=int, default=4, choices=(2, 4))
    p.add_argument("--backends", nargs="+", default=["CUSTOM", "FLASH_ATTN"])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--ablate", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one backend here
    a = p.parse_args()
    if a.one:
        for row in run_one(a):
            print("ROW " + json.dumps(row), flush=True)
        return 0
    if not a.out:
        p.error("--out is required")
    from provenance import provenance, write_result

    rows = []
    for backend in a.backends:
        cmd = [sys.executable, os.path.abspath(__file__), a.model, "--one", backend,
               "--bits", str(a.bits), "--prompt", str(a.prompt)] + (["--ablate"] if a.ablate else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not got:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            print(f"bench_steps: {backend} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        for row in got:
            print(json.dumps(row))
        rows += got
    write_result(a.out, dict(provenance(), bits=a.bits, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
