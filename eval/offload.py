"""KV pages that leave the GPU, CUSTOM beside FLASH_ATTN bf16: what they weigh, and how fast a
long prefix comes back from host memory.

    python eval/offload.py bytes [--host-gib 64] [--tokens 32768]   # no GPU; docs/offload.md quotes it
    python eval/offload.py ttft                                     # Llama-3-8B shape, dummy weights, CUSTOM 4 bits
    python eval/offload.py ttft --model DIR --codebooks FILE        # a real model and its codebooks

``bytes``: host memory per cached token and per 32K-token conversation, and what a prefill
instance hands a decode instance for one prompt. Page sizes come from the package's own
layout (``layout.PageLayout``, ``layout.subspaces``, the default block size and window in
``config``), so the numbers follow the page layout the backend serves.

``ttft``: time to first token of a long prefix, recomputed, from the GPU prefix cache, or
loaded back from host memory by vLLM's CPU offloading (``SimpleCPUOffloadConnector``:
``--kv-offloading-size`` with VLLM_USE_SIMPLE_KV_OFFLOAD=1), CUSTOM beside FLASH_ATTN bf16
in one run on the same machine and settings, with the bytes a host reload moves per request.

About 7 minutes on one H200 with the defaults, most of it two engine starts that compile
the model when the compile cache is cold (``--enforce-eager`` skips that); per backend, 6
repeats of three 32K-token prefills and two cache hits. Writes ``--out`` (default
eval/results/offload_ttft.json), which eval/report.py's ``offload-ttft`` table reads.

Each backend runs in its own process: one offline ``LLM`` with prefix caching, the
connector (``--kv-offloading-size`` GiB of pinned host memory) and block size 128, one
request at a time. A repeat takes a fresh random prefix P (the same token ids for every
backend) and times three requests, each P plus a fresh suffix, one output token:

  recompute  P never seen: prefilled whole (and stored to host memory as it goes);
  gpu        P's blocks from the GPU prefix cache;
  host       after two other prompts of the same length have evicted P from a GPU cache
             of 1.25 prompts (``num_gpu_blocks_override``), P's blocks loaded from host memory.

TTFT is vLLM's own: ``RequestOutput.metrics.first_token_latency`` (arrival to the step that
returned the first token; engine statistics on); the wall time of ``generate`` between two
``torch.cuda.synchronize()`` is recorded beside it. The first repeat is a warm-up, not
counted. Every request's change in vLLM's hit counters (``vllm:prefix_cache_hits``,
``vllm:external_prefix_cache_hits``, tokens) must be what its case claims: (0, 0), (R, 0)
and (0, R) with R = P's whole blocks; a repeat where they are not is recorded as invalid with
its counts and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from common import codebook_meta, provenance, size, write_model_dir, write_result
from vllm_pq_backend.config import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW
from vllm_pq_backend.layout import PageLayout, subspaces

BACKENDS = ("CUSTOM", "FLASH_ATTN")
CASES = ("recompute", "gpu", "host")
BLOCK = 128  # both engines: CUSTOM's default block, so that their pages hold the same tokens
FILLERS = 2  # prompts that evict the prefix from the GPU cache before the host case
GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="offload.py ttft", description="Time to first token of a long prefix: recomputed, from the GPU prefix cache, or from host memory")
    p.add_argument("--model", help="a local model folder (default: one of Llama-3-8B's shape "
                   "with dummy weights and random codebooks, made here)")
    p.add_argument("--codebooks", help="CUSTOM's codebook file (default: the model folder's "
                   "file for --bits)")
    p.add_argument("--bits", type=int, default=4, choices=(1, 2, 4), help="CUSTOM's bits per "
                   "element (K and V) without --codebooks")
    p.add_argument("--dummy-weights", action="store_true", help="random weights "
                   "(load_format=dummy) for a --model folder that has only its config")
    p.add_argument("--prefix-tokens", type=int, default=32768)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats, after one warm-up")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--kv-offloading-size", type=float, default=16.0,
                   help="GiB of host memory for the offloaded KV cache, per engine")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile or CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="eval/results/offload_ttft.json")
    p.add_argument("--engine", choices=BACKENDS, help=argparse.SUPPRESS)  # a child: this backend
    p.add_argument("--raw", help=argparse.SUPPRESS)  # where the child writes its measurements
    a = p.parse_args(argv)
    if a.prefix_tokens < BLOCK or a.suffix_tokens < 1 or a.repeats < 1:
        p.error(f"--prefix-tokens must be at least {BLOCK}, --suffix-tokens and --repeats at least 1")
    return a


# --- bytes: pages as connectors move them ---------------------------------------------

# (name, layers, KV heads, head_dim)
MODELS = (("Llama-3-8B", 32, 8, 128), ("SmolLM2-135M", 30, 3, 64))
# (label, bits per element of K, of V); None: FLASH_ATTN's dense bf16 page
RATES = (("FLASH_ATTN bf16", None, None), ("CUSTOM 4 bits", 4, 4),
         ("CUSTOM 3 bits (K4/V2)", 4, 2), ("CUSTOM 2 bits", 2, 2))
BF16 = 2  # bytes
HOST_PAGE = 4096  # vLLM's CPUOffloadingSpec rounds each host chunk up to the OS page size


def block_bytes(layers, heads, head_dim, bits_k, bits_v, block=DEFAULT_BLOCK_SIZE) -> int:
    """One vLLM block of every layer: what an offloading connector copies per block."""
    if bits_k is None:
        per_head = block * 2 * head_dim * BF16  # K and V, head_dim elements each
    else:
        per_head = PageLayout(block, subspaces(head_dim, bits_k),
                              subspaces(head_dim, bits_v)).head_bytes
    return layers * heads * per_head


def window_row_bytes(layers, heads, head_dim) -> int:
    """One token's full-precision K and V in the window store, every layer (bf16)."""
    return layers * heads * 2 * head_dim * BF16


def host_table(host_gib: float, tokens: int) -> list[str]:
    b = DEFAULT_BLOCK_SIZE
    blocks = math.ceil(tokens / b)
    out = [f"Host memory (block {b} tokens; a {tokens}-token conversation is {blocks} "
           f"blocks; {host_gib:g} GiB of host memory)", "",
           "| model | KV cache | bytes per token | per conversation | conversations |",
           "|---|---|---:|---:|---:|"]
    for name, layers, heads, d in MODELS:
        for label, bk, bv in RATES:
            per_block = block_bytes(layers, heads, d, bk, bv)
            chunk = -(-per_block // HOST_PAGE) * HOST_PAGE
            pad = "" if chunk == per_block else f" (+{chunk - per_block} B host padding)"
            fit = int(host_gib * GIB) // chunk // blocks
            out.append(f"| {name} | {label} | {per_block // b:,}{pad} | "
                       f"{size(blocks * chunk)} | {fit:,} |")
    return out


def handoff_table(tokens_list: list[int]) -> list[str]:
    """Prefill -> decode for one prompt on Llama-3-8B: whole blocks as a connector moves
    them (the last, partial one included), plus the window rows of the last segment; or
    only the blocks before the last segment, the decode instance recomputing the rest."""
    name, layers, heads, d = MODELS[0]
    b, w = DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW
    out = [f"Prefill to decode, one prompt on {name} (block {b}, window {w})", "",
           "| prompt tokens | KV cache | what crosses | bytes | vs bf16 |",
           "|---:|---|---|---:|---:|"]
    for n in tokens_list:
        blocks = math.ceil(n / b)
        seg = (n - 1) // w * w  # the last segment's start (layout.window_start)
        full = (n - 1) // b  # blocks before the block holding the last token
        dense = blocks * block_bytes(layers, heads, d, None, None)
        out.append(f"| {n:,} | FLASH_ATTN bf16 | {blocks} blocks | {size(dense)} | 1.000 |")
        for label, bk, bv in RATES[1:]:
            per_block = block_bytes(layers, heads, d, bk, bv)
            rows = (n - seg) * window_row_bytes(layers, heads, d)
            with_rows = blocks * per_block + rows
            out.append(f"| {n:,} | {label} | {blocks} blocks + {n - seg} window rows "
                       f"({size(rows)}) | {size(with_rows)} | {with_rows / dense:.3f} |")
            recompute = full * per_block
            out.append(f"| {n:,} | {label} | {full} blocks; decode recomputes the last "
                       f"{n - full * b} tokens | {size(recompute)} | "
                       f"{recompute / dense:.3f} |")
    return out


def bytes_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="offload.py bytes", description="Host memory per cached token and per conversation, and the prefill-to-decode hand-off (no GPU)")
    p.add_argument("--host-gib", type=float, default=64.0, help="host memory for the cache")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per conversation")
    p.add_argument("--prompts", type=int, nargs="+", default=[32768, 32700],
                   help="prompt lengths for the prefill-to-decode table")
    a = p.parse_args(argv)
    print("\n".join(host_table(a.host_gib, a.tokens) + [""] + handoff_table(a.prompts)))
    return 0



# --- what each case must show in vLLM's hit counters ------------------------------------


def reused_tokens(prefix_tokens: int, block: int = BLOCK) -> int:
    """Tokens of the prefix that a hit can reuse: its whole blocks (the suffix follows, so
    the last prompt token, which vLLM always computes, is past them)."""
    return prefix_tokens // block * block


def expected_hits(case: str, reused: int) -> tuple[int, int]:
    """(local, external) prefix-cache hit tokens a request of ``case`` must count."""
    return {"recompute": (0, 0), "gpu": (reused, 0), "host": (0, reused)}[case]


def is_valid(case: str, local: int, external: int, reused: int) -> bool:
    return (local, external) == expected_hits(case, reused)


def summarize(repeats: list[dict]) -> dict:
    """Medians over the valid repeats (``ttft_s``, ``wall_s``, ``valid`` each), in ms."""
    valid = [r for r in repeats if r["valid"]]

    def med(key):
        return round(1e3 * statistics.median(r[key] for r in valid), 1) if valid else None

    return dict(ttft_ms_median=med("ttft_s"), wall_ms_median=med("wall_s"),
                valid_repeats=len(valid), repeats=len(repeats))


# --- bytes of the cases ---------------------------------------------------------------


def model_shape(model: str) -> dict:
    from transformers import AutoConfig

    from vllm_pq_backend.codebooks import head_dim_of

    cfg = AutoConfig.from_pretrained(model).get_text_config()
    return dict(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                head_dim=head_dim_of(cfg), vocab=cfg.vocab_size)


def page_bytes(shape: dict, bits_k, bits_v, block: int = BLOCK) -> int:
    """One block of every layer as the connector copies it; bits None: a dense bf16 page."""
    return block_bytes(shape["layers"], shape["kv_heads"], shape["head_dim"],
                                     bits_k, bits_v, block)


def host_check(shape: dict, bits_k, bits_v, blocks: int, gib: float) -> str | None:
    """Why ``gib`` of host memory cannot keep a prefix while FILLERS prompts are stored
    after it, requests of ``blocks`` blocks each (None if it can)."""
    need = (1 + FILLERS) * blocks * page_bytes(shape, bits_k, bits_v)
    if need <= gib * GIB:
        return None
    return (f"--kv-offloading-size {gib:g} GiB cannot hold the prefix and the {FILLERS} prompts "
            f"stored after it ({need / GIB:.2f} GiB): raise it to {math.ceil(need / GIB)}")


# --- one engine (child process) ------------------------------------------------------------


def prompt_blocks(args) -> int:
    """Blocks of one request: prefix, suffix and the output token."""
    return -(-(args.prefix_tokens + args.suffix_tokens + 1) // BLOCK)


def gpu_blocks(args) -> int:
    """The GPU cache: one request and a quarter, so that FILLERS requests evict a prefix."""
    return prompt_blocks(args) + prompt_blocks(args) // 4


def measure(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(attention_backend=args.engine)
    if args.engine == "CUSTOM":
        kw["additional_config"] = {"pq": {"codebooks": args.codebooks}}
    t0 = time.time()
    llm = LLM(model=args.model, load_format="dummy" if args.dummy_weights else "auto",
              skip_tokenizer_init=True, dtype="bfloat16", seed=0, block_size=BLOCK,
              max_model_len=args.prefix_tokens + args.suffix_tokens + 1,
              enable_prefix_caching=True, kv_offloading_size=args.kv_offloading_size,
              num_gpu_blocks_override=gpu_blocks(args), max_num_seqs=4,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, disable_log_stats=False, **kw)
    cfg = llm.llm_engine.vllm_config
    connector = cfg.kv_transfer_config.kv_connector
    if connector != "SimpleCPUOffloadConnector":
        raise RuntimeError(f"the engine runs {connector}, not SimpleCPUOffloadConnector")
    info = dict(engine_start_s=round(time.time() - t0, 1), connector=connector,
                device=torch.cuda.get_device_name(), kv_cache_blocks=cfg.cache_config.num_gpu_blocks,
                block_size=cfg.cache_config.block_size,
                max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(args.seed)  # the same prompts for every backend
    vocab = model_shape(args.model)["vocab"]
    lo, hi = min(1000, vocab // 2), min(120000, vocab)  # clear of the low special tokens

    def tokens(n):
        return [rng.randrange(lo, hi) for _ in range(n)]

    def hits():
        got = {m.name: m.value for m in llm.get_metrics()
               if m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")}
        return got.get("vllm:prefix_cache_hits", 0), got.get("vllm:external_prefix_cache_hits", 0)

    def request(ids):
        torch.cuda.synchronize()  # earlier stores to host memory finish before the clock starts
        local, external = hits()
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        local2, external2 = hits()
        return dict(ttft_s=out.metrics.first_token_latency, wall_s=wall,
                    local_hits=int(local2 - local), external_hits=int(external2 - external))

    repeats = []
    for _ in range(1 + args.repeats):  # the first is the warm-up
        prefix = tokens(args.prefix_tokens)
        got = {"recompute": request(prefix + tokens(args.suffix_tokens)),
               "gpu": request(prefix + tokens(args.suffix_tokens))}
        for _ in range(FILLERS):
            request(tokens(args.prefix_tokens + args.suffix_tokens))
        got["host"] = request(prefix + tokens(args.suffix_tokens))
        repeats.append(got)
        print(json.dumps(got), flush=True)
    return dict(info, warmup=repeats[0], repeats=repeats[1:])


# --- the run ----------------------------------------------------------------------------------


def label(backend: str, meta: dict | None) -> str:
    if backend != "CUSTOM":
        return f"{backend} bf16"
    bk, bv = meta["bits_k"], meta["bits_v"]
    return f"CUSTOM {bk} bits" if bk == bv else f"CUSTOM K{bk}/V{bv} ({(bk + bv) / 2:g} bits)"


def engine_result(backend: str, raw: dict, shape: dict, meta: dict | None,
                  prefix_tokens: int) -> tuple[dict, list[dict]]:
    """(the engine's entry, its rows: one per case) from a child's measurements."""
    name = label(backend, meta)
    bits = (meta["bits_k"], meta["bits_v"]) if meta else (None, None)
    per_block = page_bytes(shape, *bits)
    engine = dict(backend=name, attention_backend=backend, page_bytes_per_block=per_block,
                  bytes_per_token=per_block // BLOCK, **(meta or {}))
    if "error" in raw:
        return dict(engine, error=raw["error"]), []
    reused = reused_tokens(prefix_tokens, raw["block_size"])

    def checked(case, r):
        return dict(r, valid=is_valid(case, r["local_hits"], r["external_hits"], reused))

    engine.update({k: v for k, v in raw.items() if k not in ("warmup", "repeats")})
    engine["warmup"] = {c: checked(c, r) for c, r in raw["warmup"].items()}
    rows = []
    for case in CASES:
        reps = [checked(case, rep[case]) for rep in raw["repeats"]]
        # bytes a valid request of this case loads from host memory: its external hits, in
        # whole blocks of this backend's page
        want = expected_hits(case, reused)
        rows.append(dict(backend=name, case=case, **summarize(reps), expected_hits=list(want),
                         bytes_from_host=want[1] // raw["block_size"] * per_block,
                         repeat_results=[dict(ttft_ms=round(1e3 * r["ttft_s"], 1),
                                              wall_ms=round(1e3 * r["wall_s"], 1),
                                              local_hits=r["local_hits"], external_hits=r["external_hits"],
                                              valid=r["valid"]) for r in reps]))
    return engine, rows


def run_child(args, backend: str, model: str, books: str | None, dummy: bool, raw: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "ttft", "--model", model, "--engine", backend,
           "--raw", raw, "--prefix-tokens", str(args.prefix_tokens), "--suffix-tokens",
           str(args.suffix_tokens), "--repeats", str(args.repeats), "--kv-offloading-size",
           str(args.kv_offloading_size), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--seed", str(args.seed)]
    cmd += (["--codebooks", books] if books else []) + (["--dummy-weights"] if dummy else []) \
        + (["--enforce-eager"] if args.enforce_eager else [])
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_SIMPLE_KV_OFFLOAD="1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode or not os.path.exists(raw):
        return dict(error=f"the {backend} engine's process exited with {proc.returncode}")
    return json.load(open(raw))


def run(args, work: str) -> dict:
    """Every backend's engine in turn, in child processes; the run's results."""
    from vllm_pq_backend.config import default_codebook_path

    dummy = args.dummy_weights or args.model is None
    model = args.model or write_model_dir(os.path.join(work, "llama3-8b-shape"), [subspaces(128, args.bits)])
    shape = model_shape(model)
    books = meta = None
    if "CUSTOM" in args.backends:
        books = args.codebooks or default_codebook_path(model, subspaces(shape["head_dim"], args.bits))
        if not os.path.exists(books):
            sys.exit(f"offload.py ttft: no codebooks at {books}: pass --codebooks FILE "
                     "(python -m vllm_pq_backend.calibrate writes them)")
        meta = codebook_meta(books)
    for backend in args.backends:
        bits = (meta["bits_k"], meta["bits_v"]) if backend == "CUSTOM" else (None, None)
        why = host_check(shape, *bits, prompt_blocks(args), args.kv_offloading_size)
        if why:
            sys.exit(f"offload.py ttft: {label(backend, meta)}: {why}")

    engines, rows = [], []
    for backend in args.backends:
        raw = run_child(args, backend, model, books, dummy, os.path.join(work, f"{backend}.json"))
        engine, got = engine_result(backend, raw, shape, meta if backend == "CUSTOM" else None,
                                    args.prefix_tokens)
        engines.append(engine)
        rows += got
        for r in got:
            print(f"{r['backend']} {r['case']}: TTFT {r['ttft_ms_median']} ms "
                  f"({r['valid_repeats']} of {r['repeats']} valid)", flush=True)
    device = next((e["device"] for e in engines if "device" in e), "unknown")
    return dict(provenance(device), model=args.model or "Llama-3-8B shape",
                weights="dummy" if dummy else "loaded", model_shape=shape,
                prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                repeats=args.repeats, kv_offloading_size_gib=args.kv_offloading_size,
                connector="SimpleCPUOffloadConnector", block_size=BLOCK, gpu_blocks=gpu_blocks(args),
                fillers=FILLERS, enforce_eager=args.enforce_eager,
                gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                ttft="RequestOutput.metrics.first_token_latency", engines=engines, rows=rows)


def ttft_main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine:  # a child: one engine, measured
        with open(args.raw, "w") as f:
            json.dump(measure(args), f)
        return 0
    with tempfile.TemporaryDirectory(prefix="offload-ttft-") as work:
        result = run(args, work)
    write_result(args.out, result)
    return 0 if all("error" not in e for e in result["engines"]) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"bytes": bytes_main, "ttft": ttft_main}
    if not argv or argv[0] not in modes:
        sys.exit("usage: offload.py {bytes,ttft} [options]  (offload.py MODE --help for each)")
    return modes[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
