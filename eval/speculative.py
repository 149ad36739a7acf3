"""Speculative decoding with drafts that have attention layers, CUSTOM serving the target:
an engine without speculation beside one with, on the same prompts, for each case.

    python eval/speculative.py                      # both cases, CUSTOM 4 bits, full depth
    python eval/speculative.py --layers 4           # a fast run: 4 target layers each
    python eval/speculative.py --backends CUSTOM FLASH_ATTN

Cases (dummy weights, ``load_format="dummy"``, so no checkpoint is needed; the target's
drawn again at a scale that suits its width, ``redraw_weights``):

  eagle3  a Llama-3-8B-shaped target (hidden 4096, 32 query / 8 KV heads, head_dim 128,
          32 layers) and a one-layer EAGLE-3 draft of its shape (``draft_load_config``
          dummy), reading the target's hidden states after 2, 16 and 29 of its layers.
  mtp     a MiMo-7B-shaped target (``MiMoForCausalLM``: Qwen2 attention, hidden 4096, 32
          query / 8 KV heads, head_dim 128, 36 layers) and its one MTP layer
          (``num_nextn_predict_layers: 1``), method ``mtp``: a Qwen2 config.json, so no
          remote code.

The draft layers run on FLASH_ATTN (``"attention_backend": "FLASH_ATTN"`` in the
speculative config) with dense bf16 pages in the target's KV cache group; the target's
layers on CUSTOM with random codebooks (4 bits per element by default: speed and
correctness of the verification path do not depend on what the centroids are).

Every engine: ``VLLM_BATCH_INVARIANT=1``, eager (no torch.compile or CUDA graphs),
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine in this process, one after another),
async scheduling off (CUSTOM refuses speculation under it), block 128, greedy sampling,
``--prompts`` token-id prompts of 96 to 320 tokens (past the 128-token residual window)
with ``--max-tokens`` output tokens each, all in one batch. Each engine runs the prompts
twice: a warm-up generate, then a timed one.

Recorded per engine: greedy outputs (with speculation: how many prompts give exactly the
tokens of the engine without, in both generates), vLLM's ``vllm:spec_decode_num_drafts``,
``_draft_tokens`` and ``_accepted_tokens`` over the timed generate, KV cache capacity in
tokens and bytes per token (the target's pages and the draft's apart), device memory
the engine holds once started (this process's ``torch.cuda.memory_reserved`` before and
after, so other processes on the GPU do not count), and the
time per output token of the timed generate (vLLM's per-request timestamps; eager
batch-invariant mode, so slower than served with CUDA graphs). A draft of dummy weights
predicts nothing of the target: the counts show that verification ran, not what a trained
draft would have accepted.

Exits 1, naming the case, if any prompt's greedy output with speculation differs from the
one without, or an engine without speculation does not repeat its own outputs. Writes
``--out`` (default eval/results/speculative.json), which eval/report.py's
``speculative`` table renders. Most of the time is engine starts, 30-60 s each on one H200
(four with the defaults, two more per backend added); ``--layers 4`` shortens them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

from common import LLAMA3_8B, codebook_meta, provenance, write_model_dir, write_result
from vllm_pq_backend.layout import subspaces

BACKENDS = ("CUSTOM", "FLASH_ATTN")
BLOCK = 128  # CUSTOM's default block, for both backends' pages
DRAFT_BACKEND = "FLASH_ATTN"
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")

# MiMo-7B's shape as vLLM reads it without remote code: a Qwen2 config with MiMo's
# architecture and its MTP layer count
MIMO_7B = {
    "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 151680, "max_position_embeddings": 32768,
    "rope_theta": 640000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
    "bos_token_id": 151643, "eos_token_id": 151643,
}

# name, target shape, the target's name in the results, the speculative method
CASES = {
    "eagle3": ("EAGLE-3", LLAMA3_8B, "Llama-3-8B shape", "eagle3"),
    "mtp": ("MTP", MIMO_7B, "MiMo-7B shape", "mtp"),
}


# --- model folders (config.json only: served with dummy weights) -----------------------


def target_config(case: str, layers: int | None = None, **changes) -> dict:
    """The case's target config, cut to ``layers`` layers where given, with ``changes`` (a
    smaller shape for tests)."""
    cfg = dict(CASES[case][1], **changes)
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def write_target(path: str, config: dict, bits: int) -> tuple[str, str]:
    """(the model folder, its codebook file): ``config`` as config.json and random
    codebooks at ``bits`` bits per element for K and V."""
    from vllm_pq_backend.config import default_codebook_path

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    m = subspaces(head_dim, bits)
    write_model_dir(path, [m], config=config)
    return path, default_codebook_path(path, m)


def eagle3_aux_layers(layers: int) -> list[int]:
    """The target hidden states an EAGLE-3 head reads (0: the embeddings, i: after i
    layers): vLLM's default (2, L/2, L-3) where it names three distinct ones, else the
    embeddings, the middle and the last."""
    default = [2, layers // 2, layers - 3]
    return default if default[0] < default[1] < default[2] else [0, layers // 2, layers]


def eagle3_draft(target: str, path) -> str:
    """A one-layer EAGLE-3 head of the target's shape (weights: load_format dummy) with
    the target's vocabulary, reading three of its hidden states (eagle3_aux_layers)."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    aux = eagle3_aux_layers(cfg["num_hidden_layers"])
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=cfg["vocab_size"], eagle_aux_hidden_state_layer_ids=aux,
               eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def speculative_config(method: str, tokens: int, draft: str | None = None) -> dict:
    """--speculative-config for ``method``: the draft layers on DRAFT_BACKEND; an EAGLE-3
    head from ``draft`` with dummy weights, MTP from the target's own folder."""
    spec = {"method": method, "num_speculative_tokens": tokens,
            "attention_backend": DRAFT_BACKEND}
    if method == "eagle3":
        spec.update(model=draft, draft_load_config={"load_format": "dummy"})
    return spec


# --- prompts and engines ----------------------------------------------------------------


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of 96, 128, ... 320 tokens (the residual window is 128), ids
    clear of the low special tokens."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 2), min(120000, vocab)
    return [[rng.randrange(lo, hi) for _ in range(96 + 32 * (i % 8))] for i in range(n)]


def settle() -> None:
    """Free what a dropped engine held before the next one profiles memory."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def engine_kwargs(backend: str, books: str | None) -> tuple[dict, str]:
    """`LLM` keyword arguments that pick ``backend``, and its rows' name."""
    if backend == "CUSTOM":
        meta = codebook_meta(books)
        return (dict(attention_backend="CUSTOM", additional_config={"pq": {"codebooks": books}}),
                f"CUSTOM {meta['bits_k']} bits")
    return dict(attention_backend=backend), f"{backend} bf16"


def spec_counts(metrics) -> dict:
    """vLLM's speculative-decoding counters of ``llm.get_metrics()`` by short name (drafts,
    draft_tokens, accepted_tokens, accepted_tokens_per_pos); absent without speculation."""
    out = {}
    for m in metrics:
        name = m.name.removeprefix("vllm:spec_decode_num_")
        if name in COUNTERS:
            out[name] = m.value
        elif name == "accepted_tokens_per_pos":
            out[name] = list(m.values)
    return out


def kv_cache(llm) -> dict:
    """The engine's KV cache: blocks, groups, and every layer's page in bytes. The
    scheduler's groups keep one layer's spec each; the worker's specs give every layer's
    page, the draft's dense ones beside the target's."""
    core = llm.llm_engine.engine_core.engine_core
    kv = core.scheduler.kv_cache_config
    return dict(num_blocks=kv.num_blocks, kv_cache_groups=len(kv.kv_cache_groups),
                pages={name: s.page_size_bytes
                       for name, s in core.model_executor.get_kv_cache_specs()[0].items()})


WEIGHTS = ("load_format dummy, then the target's drawn again (redraw_weights): each matrix "
           "N(0, 1/fan_in), fan_in its input width (std 0.016 at hidden 4096), norms 1, "
           "biases 0; the draft's stay dummy")


def redraw_weights(model) -> None:
    """The target's weights drawn again, for ``LLM.apply_model``: vLLM's dummy weights
    (uniform in +-1e-3) make every output one repeated token, against which any engine
    is "identical". Each matrix N(0, 1/fan_in), fan_in its last dimension (the input width
    of vLLM's linear, embedding and expert weights): activations keep their size at any
    width, where one fixed deviation (0.02) leaves a model of hidden size 256 repeating
    tokens. Norms 1, biases 0; each matrix from a generator seeded by the parameter's
    name, so that engines with and without speculation hold the same model."""
    import zlib

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * p.shape[-1] ** -0.5)


def measure(model: str, backend_kw: dict, spec: dict | None, ids: list[list[int]], args) -> dict:
    """One engine started, run twice on ``ids`` (a warm-up, then timed) and dropped."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settle()
    reserved, total = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[1]
    t0 = time.time()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              seed=0, enforce_eager=True, async_scheduling=False, block_size=BLOCK,
              max_model_len=max(map(len, ids)) + args.max_tokens + args.num_speculative_tokens,
              max_num_seqs=len(ids), gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              disable_log_stats=False, speculative_config=spec, **backend_kw)
    llm.apply_model(redraw_weights)
    start_s = time.time() - t0
    held = torch.cuda.memory_reserved() - reserved
    kv = kv_cache(llm)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                        detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
    warmup = [o.outputs[0].token_ids for o in llm.generate(requests, sp, use_tqdm=False)]
    before = spec_counts(llm.get_metrics())
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate(requests, sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    after = spec_counts(llm.get_metrics())
    del llm
    settle()
    return dict(
        engine_start_s=round(start_s, 1), gpu_memory_bytes=held,
        gpu_total_bytes=total, block_size=BLOCK, **kv, warmup=[list(x) for x in warmup],
        outputs=[list(o.outputs[0].token_ids) for o in out], wall_s=wall,
        tpot_s=[(o.metrics.last_token_ts - o.metrics.first_token_ts)
                / max(1, o.metrics.num_generation_tokens - 1) for o in out],
        counters={k: delta(before.get(k), v) for k, v in after.items()})


def delta(before, after):
    """A counter's (or per-position vector's) change over the timed generate."""
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before or [0] * len(after))]
    return after - (before or 0)


# --- results (pure Python) ---------------------------------------------------------------

LAYER = re.compile(r"layers\.(\d+)\.")


def kv_split(pages: dict[str, int], target_layers: int) -> tuple[int, int]:
    """(target, draft) bytes of one block of every layer: the draft's layers are numbered
    after the target's (EAGLE heads and MTP layers alike)."""
    target = draft = 0
    for name, size in pages.items():
        m = LAYER.search(name)
        if m is None:
            raise ValueError(f"speculative.py: no layer number in KV cache layer {name!r}")
        if int(m.group(1)) < target_layers:
            target += size
        else:
            draft += size
    return target, draft


def engine_row(raw: dict, target_layers: int) -> dict:
    """What one engine's measurements say, for the results."""
    target, draft = kv_split(raw["pages"], target_layers)
    block = raw["block_size"]
    tokens = raw["num_blocks"] // raw["kv_cache_groups"] * block  # as vLLM reports it
    c = raw["counters"]
    row = dict(
        engine_start_s=raw["engine_start_s"], gpu_memory_bytes=raw["gpu_memory_bytes"],
        kv_cache_tokens=tokens, kv_cache_bytes=raw["num_blocks"] * (target + draft),
        bytes_per_token=(target + draft) / block, target_bytes_per_token=target / block,
        draft_bytes_per_token=draft / block,
        tpot_ms_median=round(1e3 * statistics.median(raw["tpot_s"]), 2),
        wall_s=round(raw["wall_s"], 3),
        output_tokens=sum(map(len, raw["outputs"])),
        distinct_output_tokens_min=min(len(set(o)) for o in raw["outputs"]))
    if c:
        row.update({k: c.get(k, 0) for k in COUNTERS},
                   accepted_tokens_per_pos=c.get("accepted_tokens_per_pos"),
                   acceptance_rate=round(c["accepted_tokens"] / c["draft_tokens"], 4)
                   if c.get("draft_tokens") else None)
    return row


def pair_rows(case: str, backend: str, plain: dict, spec: dict, target_layers: int,
              speculation: str) -> list[dict]:
    """The rows of one backend's pair of engines: without and with speculation; the
    latter counts the prompts whose greedy tokens equal the former's in both of its
    generates, the former those it repeats itself."""
    n = len(plain["outputs"])
    ref = plain["outputs"]
    repeats = sum(a == b for a, b in zip(plain["warmup"], ref))
    same = sum(a == r and b == r for a, b, r in zip(spec["warmup"], spec["outputs"], ref))
    without = dict(case=case, backend=backend, speculation="none", prompts=n,
                   repeats_itself=repeats, **engine_row(plain, target_layers))
    with_ = dict(case=case, backend=backend, speculation=speculation, prompts=n,
                 identical_prompts=same, **engine_row(spec, target_layers))
    with_["tpot_vs_without"] = round(with_["tpot_ms_median"] / without["tpot_ms_median"], 3)
    return [without, with_]


MIN_DISTINCT = 8  # distinct tokens an output must hold for its identity to mean something


def failures(rows: list[dict]) -> list[str]:
    """Why the run fails: prompts whose outputs differ, a reference that does not repeat
    itself (then it is no reference), or outputs too degenerate to compare."""
    out = []
    for r in rows:
        where = f"{r['case']}, {r['backend']}"
        if r.get("distinct_output_tokens_min", MIN_DISTINCT) < MIN_DISTINCT:
            out.append(f"{where}: an output holds {r['distinct_output_tokens_min']} distinct "
                       f"tokens (fewer than {MIN_DISTINCT}): outputs that degenerate show no "
                       f"identity")
        if r.get("repeats_itself", r["prompts"]) < r["prompts"]:
            out.append(f"{where}: without speculation, {r['prompts'] - r['repeats_itself']} of "
                       f"{r['prompts']} prompts give other tokens in the timed generate than "
                       f"in the warm-up")
        if r.get("identical_prompts", r["prompts"]) < r["prompts"]:
            out.append(f"{where}: with {r['speculation']}, {r['prompts'] - r['identical_prompts']}"
                       f" of {r['prompts']} prompts' greedy outputs differ from those without")
    return out


# --- the run -------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Speculative decoding (EAGLE-3, MTP) with the "
                                "target on CUSTOM: greedy identity, acceptance, KV capacity, "
                                "memory and time per token, without and with speculation")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--backends", nargs="+", default=["CUSTOM"], choices=BACKENDS,
                   help="the target's backend; each adds an engine pair (30-60 s a start)")
    p.add_argument("--layers", type=int, help="target layers (default: the shape's own, "
                   "32 and 36); fewer for a fast run")
    p.add_argument("--bits", type=int, default=4, choices=(1, 2, 4),
                   help="CUSTOM's bits per element, K and V")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV cache's "
                   "size, the same for every engine, instead of what memory profiling leaves "
                   "(so other processes may share the GPU)")
    p.add_argument("--out", default="eval/results/speculative.json")
    a = p.parse_args(argv)
    if a.layers is not None and a.layers < 2:
        p.error("--layers must be at least 2")
    if a.prompts < 1 or a.max_tokens < 2 or a.num_speculative_tokens < 1:
        p.error("--prompts and --num-speculative-tokens must be at least 1, --max-tokens 2")
    return a


def run_case(case: str, args, work: str) -> tuple[dict, list[dict]]:
    """The case's entry and its rows: each backend without and with speculation."""
    name, _, shape_name, method = CASES[case]
    cfg = target_config(case, args.layers)
    layers = cfg["num_hidden_layers"]
    model, books = write_target(os.path.join(work, case), cfg, args.bits)
    draft = eagle3_draft(model, os.path.join(work, case + "-draft")) if method == "eagle3" else None
    spec = speculative_config(method, args.num_speculative_tokens, draft)
    ids = prompts(args.prompts, cfg["vocab_size"])
    speculation = f"{method}, {args.num_speculative_tokens} tokens, draft on {DRAFT_BACKEND}"
    rows = []
    for backend in args.backends:
        kw, label = engine_kwargs(backend, books)
        plain = measure(model, kw, None, ids, args)
        with_spec = measure(model, kw, spec, ids, args)
        rows += pair_rows(name, label, plain, with_spec, layers, speculation)
        print(json.dumps(rows[-1]), flush=True)
    entry = dict(case=name, method=method, target=f"{shape_name}, {layers} layers",
                 target_config=cfg, draft="one-layer EAGLE-3 head of the target's shape"
                 if draft else f"the target's {cfg['num_nextn_predict_layers']} MTP layer",
                 speculative_config={k: v for k, v in spec.items() if k != "model"},
                 prompt_tokens=[len(p) for p in ids], codebooks=codebook_meta(books))
    return entry, rows


def main(argv=None) -> int:
    args = parse_args(argv)
    # the mode every engine here runs in: set before vLLM is imported
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cases, rows = [], []
    with tempfile.TemporaryDirectory(prefix="speculative-") as work:
        for case in args.cases:
            entry, got = run_case(case, args, work)
            cases.append(entry)
            rows += got
    meta = {k: cases[0]["codebooks"][k] for k in ("bits_k", "bits_v")}
    result = dict(provenance(), **meta,
                  weights=WEIGHTS,
                  mode="eager, VLLM_BATCH_INVARIANT=1, async scheduling off, "
                       "VLLM_ENABLE_V1_MULTIPROCESSING=0",
                  prompts=args.prompts, max_tokens=args.max_tokens,
                  num_speculative_tokens=args.num_speculative_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes, block_size=BLOCK,
                  tpot="median over prompts of (last_token_ts - first_token_ts) / "
                       "(generated tokens - 1), vLLM's RequestOutput.metrics, timed generate",
                  gpu_memory="device memory this process's allocator holds after the engine "
                             "started minus before (torch.cuda.memory_reserved)",
                  cases=cases, rows=rows)
    failed = failures(rows)
    result["pass"] = not failed
    write_result(args.out, result)
    for why in failed:
        print(f"speculative.py: FAILED: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
