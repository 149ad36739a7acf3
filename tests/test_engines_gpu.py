"""Whole vLLM engines with CUSTOM on a GPU: engines side by side, the window store's rows,
CUDA graphs, CPU offload, gpt-oss's and Qwen3's attention, speculative decoding. Most run the
speculation tests' tiny Llama-3-shaped target (test_speculative.tiny_target: two layers,
head_dim 64) with its weights drawn again (spec_eval.redraw_weights) so that greedy outputs
vary, and random codebooks. Needs a GPU."""


import gc
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from helpers import random_codebooks
from test_calibrate import tiny_model
from test_speculative import spec_eval, tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["the quick brown fox", "vllm serves tokens while a lazy dog", "over the lazy"]
IDS = spec_eval.prompts(3, 512)  # token-id prompts of 96-160 tokens for the tiny target
MAX_TOKENS = 48


def settle():
    """Free what dropped engines hold now: vLLM fails an engine's start-up if GPU memory is
    freed while it profiles, as a collector pass over a dead engine's cycles would do."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _settled():
    settle()
    yield
    settle()


def engine(model, books, window, eager=True, pq=None, **kw):
    """An engine on the tiny target (load_format dummy), its weights drawn again in place
    (CUDA graphs captured before keep their addresses)."""
    from vllm import LLM

    settings = dict(model=model, load_format="dummy", skip_tokenizer_init=True,
                    attention_backend="CUSTOM", enforce_eager=eager, max_model_len=512,
                    gpu_memory_utilization=0.15, max_num_seqs=8, seed=0,
                    additional_config={"pq": {"codebooks": books, "window": window, **(pq or {})}})
    llm = LLM(**{**settings, **kw})
    llm.apply_model(spec_eval.redraw_weights)
    return llm


def greedy(llm, prompts=IDS, max_tokens=MAX_TOKENS, least=spec_eval.MIN_DISTINCT):
    """Greedy token ids for token-id ``prompts``; each output must hold ``least`` distinct
    tokens, or two engines could agree on a degenerate model."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in out]
    print(f"distinct tokens per output: {[len(set(t)) for t in ids]} of {max_tokens}")
    assert min(len(set(t)) for t in ids) >= least, ids
    return ids


def test_two_engines_with_different_m_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # both engines in this process
    model, a_books = tiny_target(tmp_path / "model", "eagle3")  # 4 bits
    b_books = random_codebooks(str(tmp_path / "b.safetensors"), model, 8, seed=2)  # 1 bit
    alone = {}
    for name, books, window in (("a", a_books, 128), ("b", b_books, 0)):
        llm = engine(model, books, window)
        alone[name] = greedy(llm)
        del llm
        settle()
    assert alone["a"] != alone["b"]  # the settings differ enough to tell them apart
    a = engine(model, a_books, 128)
    b = engine(model, b_books, 0)  # built while a is alive
    for _ in range(2):  # interleaved
        assert greedy(a) == alone["a"]
        assert greedy(b) == alone["b"]


def test_window_store_smaller_than_max_num_seqs_caps_admission(tmp_path, monkeypatch):
    """window_memory leaves the store one row: the engine's scheduler admits one running
    request at a time (max_num_active_seqs), and the three prompts give what an engine with
    max_num_seqs=1 gives. Were a second request admitted, two would share a row."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
    model, books = tiny_target(tmp_path / "model", "eagle3")
    one = engine(model, books, 128, max_num_seqs=1)
    want = greedy(one)
    del one
    settle()
    capped = engine(model, books, 128, pq={"window_memory": 1e-9})
    assert capped.llm_engine.engine_core.engine_core.scheduler.max_num_active_reqs == 1
    assert greedy(capped) == want


@pytest.mark.parametrize("window", [0, 32])
def test_ngram_speculation_keeps_greedy_outputs(tmp_path, monkeypatch, window):
    """Batch-invariant eager mode: greedy outputs of the tiny Llama-3-shaped target with
    n-gram speculation (3 draft tokens, verified as multi-token queries on the prefill
    path) are those without, and drafts were accepted, so verification ran. Prompts whose
    last tokens repeat give the n-grams to match (test_speculative.ngram_prompts)."""
    from test_speculative import ngram_prompts

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model, books = tiny_target(tmp_path / "model", "eagle3")
    speculation_keeps_greedy_outputs(
        model, books, window, ngram_prompts(), 96,
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}, "n-gram", accepted=True)


def test_gpu_ngram_under_async_scheduling_is_refused_with_the_reason(tmp_path):
    """ngram_gpu runs under async scheduling by default, where the host knows verification
    steps' context lengths only as an upper bound: the engine does not start, and says why
    and what to change. In a process of its own: an engine that fails half-built leaves
    GPU memory and distributed state behind, which would upset the next engine's memory
    profile in this one."""
    model = tiny_model(tmp_path / "model", head_dim=64)
    books = random_codebooks(str(tmp_path / "a.safetensors"), model, 32, seed=1)
    code = (
        "from vllm import LLM\n"
        f"LLM(model={str(model)!r}, attention_backend='CUSTOM', enforce_eager=True, "
        "max_model_len=512, gpu_memory_utilization=0.15, max_num_seqs=8, seed=0, "
        f"additional_config={{'pq': {{'codebooks': {books!r}, 'window': 32}}}}, "
        "speculative_config={'method': 'ngram_gpu', 'num_speculative_tokens': 3, "
        "'prompt_lookup_min': 2, 'prompt_lookup_max': 4})\n"
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0
    assert re.search(r"async scheduling.*upper bound.*--no-async-scheduling", run.stderr), run.stderr[-3000:]


def test_window_rows_after_vllms_kernel_warm_up(tmp_path, monkeypatch):
    """vLLM's start-up kernel warm-up (on unless enforce_eager, which most other tests here
    set) runs max_num_seqs requests at once and frees them by name, leaving its request
    slots shuffled. Requests served together must still get window rows of their own: in
    batch-invariant mode a prompt decodes the same alone and among others, four running at
    a time (four rows)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model, books = tiny_target(tmp_path / "model", "eagle3")
    llm = engine(model, books, 32, eager=False, max_num_seqs=64, max_num_active_seqs=4,
                 compilation_config={"mode": 0, "cudagraph_mode": "NONE"})  # warm-up only
    assert llm.llm_engine.vllm_config.kernel_config.enable_jit_warmup
    alone = [greedy(llm, [p])[0] for p in IDS]
    others = spec_eval.prompts(14, 512, seed=1)
    out = greedy(llm, others[:5] + IDS + others[5:])
    assert out[5:8] == alone


@pytest.mark.parametrize("exact", [0, 2])
def test_cuda_graph_engine_pads_steps_and_matches_eager(tmp_path, monkeypatch, exact):
    """With CUDA graphs, vLLM pads a decode step's token count to a captured size, and the
    slot mapping with it (-1 past the step's tokens): three requests decode as a batch of
    4. Every other engine test here runs without graphs, where nothing is padded; this one
    failed on the first padded step when forward handed the store the padded mapping.
    Full decode graphs without torch.compile (CUSTOM takes no graphs in batch-invariant
    mode): greedy outputs are those of an eager engine, whose decode steps run the same
    kernels (prompts shorter than one codes split: plans.MIN_SPLIT_TOKENS). With the exact
    store (32-token blocks, the window's size) its corrections run in the graphs too."""
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, books = tiny_target(tmp_path / "model", "eagle3")
    kw = dict(pq={"exact": exact}, block_size=32) if exact else {}
    eager = engine(model, books, 32, **kw)
    want = greedy(eager)
    del eager
    settle()
    llm = engine(model, books, 32, eager=False,
                 compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                     "cudagraph_capture_sizes": [1, 2, 4, 8]}, **kw)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    assert mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert greedy(llm) == want


def kv_cache_shapes(model) -> dict[str, tuple]:
    """Each attention layer's KV cache tensor shape (for apply_model)."""
    return {name: tuple(m.kv_cache.shape) for name, m in model.named_modules()
            if isinstance(getattr(m, "kv_cache", None), torch.Tensor) and m.kv_cache.numel()}


@pytest.mark.parametrize("m_k,m_v", [(32, [16, 8]), ([16, 32], [16, 8])], ids=["v", "kv"])
def test_bits_by_layer_get_pages_of_their_size_and_serve_in_cuda_graphs(tmp_path, monkeypatch,
                                                                         m_k, m_v):
    """Codebooks whose layers differ in V's bits (K 4 / V 2 in layer 0, K 4 / V 1 in layer
    1) or in K's and V's (2 / 2, 4 / 1): vLLM gives each layer pages of its own bytes per
    token, the same blocks for both, and decode steps in CUDA graphs (each layer's
    kernel) give an eager engine's greedy outputs."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, _ = tiny_target(tmp_path / "model", "eagle3")
    books = random_codebooks(str(tmp_path / "mixed.safetensors"), model, m_k, m_v=m_v, seed=4)
    eager = engine(model, books, 32)
    (shapes,) = eager.apply_model(kv_cache_shapes)
    by_layer = sorted(shapes.items())
    m_ks = m_k if isinstance(m_k, list) else [m_k] * 2
    assert [s[-1] for _, s in by_layer] == [mk + mv for mk, mv in zip(m_ks, m_v)], shapes
    assert len({s[:-1] for _, s in by_layer}) == 1, shapes  # blocks, heads, tokens alike
    want = greedy(eager)
    del eager
    settle()
    llm = engine(model, books, 32, eager=False,
                 compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                     "cudagraph_capture_sizes": [1, 2, 4, 8]})
    assert greedy(llm) == want


def test_simple_cpu_offload_matches_gpu_prefix_hits(tmp_path, monkeypatch):
    """SimpleCPUOffloadConnector carries CUSTOM pages intact and resumes where a GPU
    prefix-cache hit would. Batch-invariant eager mode, window 128: a 32K-token prompt (256
    blocks exactly, and 256 blocks + 50 tokens) gives the same greedy tokens without
    caching, after a GPU prefix-cache hit, and after its prefix was evicted from the GPU
    (two other 32K prompts through a 300-block cache) and loaded back from host memory:
    that run counts external hits of every block before the last token, and no local ones."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "1")  # --kv-offloading-size picks it
    block, prefix, max_len = 128, 32768, 33024
    model, books = tiny_target(tmp_path / "model", "eagle3")
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["max_position_embeddings"] = max_len
    json.dump(cfg, open(cfg_path, "w"))
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(256, 512) for _ in range(n)]

    prompts = {tail: tokens(prefix + tail) for tail in (0, 50)}
    fillers = [tokens(prefix) for _ in range(2)]
    common = dict(max_model_len=max_len, max_num_seqs=4, block_size=block)

    def run(llm, prompt):  # 16 tokens of a 32K context: fewer distinct ones than usual
        return greedy(llm, [prompt], 16, least=2)[0]

    plain = engine(model, books, 128, **common, enable_prefix_caching=False)
    want = {tail: run(plain, p) for tail, p in prompts.items()}
    del plain
    settle()
    llm = engine(model, books, 128, **common, enable_prefix_caching=True, kv_offloading_size=1,
                 num_gpu_blocks_override=300, disable_log_stats=False)
    assert llm.llm_engine.vllm_config.kv_transfer_config.kv_connector == "SimpleCPUOffloadConnector"

    def hits():
        got = {m.name: m.value for m in llm.get_metrics() if m.name in (
            "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")}
        return got["vllm:prefix_cache_hits"], got["vllm:external_prefix_cache_hits"]

    for tail, prompt in prompts.items():
        reused = (prefix + tail - 1) // block * block  # every block before the last token
        assert run(llm, prompt) == want[tail]  # computed here, stored to host memory
        before = hits()
        assert run(llm, prompt) == want[tail]  # a GPU prefix-cache hit
        local, external = hits()
        assert (local - before[0], external - before[1]) == (reused, 0), tail
        for filler in fillers:  # evicts the prompt's blocks from the GPU cache
            run(llm, filler)
        before = hits()
        assert run(llm, prompt) == want[tail]  # its blocks loaded back from host memory
        local, external = hits()
        assert (local - before[0], external - before[1]) == (0, reused), tail


# gpt-oss (attention sinks): its attention on two layers of random weights
# (test_calibrate.gpt_oss_model) with codebooks calibrated on it


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from test_calibrate import WORDS, gpt_oss_model

    path = tmp_path_factory.mktemp("gpt_oss")
    model = gpt_oss_model(path / "model")
    text = path / "a.txt"
    rng = random.Random(0)
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(20000)))
    books = str(path / "b4.safetensors")
    # its own process: an engine started in batch-invariant mode replaces torch's matmuls
    # in this one for good, with kernels that take no float64
    subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", "--model", model,
                    "--text", str(text), "--tokens", "16384", "--seq-len", "1024", "--out", books],
                   check=True)
    return model, books


# One engine in a process of its own, outside batch-invariant mode. An engine started in
# this one under VLLM_BATCH_INVARIANT=1 (the tests above) leaves torch's CUDA softmax,
# log_softmax and bmm replaced for good; and in that mode vLLM gave this model uniform
# next-token distributions (prompt perplexity 300.000, the vocabulary's size, on
# FLASH_ATTN and CUSTOM alike), where transformers and vLLM outside the mode give a
# peaked model (transformers: perplexities near 2e5 on these prompts).
GPT_OSS_RUN = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
engine, ids, max_tokens = json.loads(sys.argv[1])
llm = LLM(**engine)
sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0)
out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
print("RESULT", json.dumps([([lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:],
                                                               o.prompt_logprobs[1:])],
                             list(o.outputs[0].token_ids)) for o in out]))
"""


def gpt_oss_run(model, backend, ids, max_tokens=1, **kw):
    """Per prompt of token ids ``ids``: (the log-probability of each prompt token after the
    first, float64 [len - 1]; the greedy tokens), from an engine on ``backend`` in a process
    of its own (GPT_OSS_RUN)."""
    engine = dict(model=model, attention_backend=backend, enforce_eager=True, max_model_len=1024,
                  gpu_memory_utilization=0.15, max_num_seqs=8, seed=0, block_size=128, **kw)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    run = subprocess.run([sys.executable, "-c", GPT_OSS_RUN, json.dumps([engine, ids, max_tokens])],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    return [(torch.tensor(lps, dtype=torch.float64), tokens)
            for lps, tokens in json.loads(line.removeprefix("RESULT "))]


def gpt_oss_prompts(model, lengths, seed):
    """Token ids of random text in the model's words (test_calibrate.WORDS), one prompt of
    each of ``lengths``."""
    from test_calibrate import WORDS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    return [tok(" ".join(rng.choice(WORDS) for _ in range(n)), add_special_tokens=False)
            .input_ids[:n] for n in lengths]


def gpt_oss_transformers(model, ids):
    """transformers' float32 forward of the folder on the CPU (the model's own eager
    attention, sinks in every softmax): per prompt, the log-probability of each token
    after the first, with the sinks and without them (every sink logit -inf: what a
    backend that ignored them would compute)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                              attn_implementation="eager").eval()

    def logprobs():
        out = []
        with torch.no_grad():
            for p in ids:
                x = torch.tensor([p])
                lp = hf(x).logits[0, :-1].double().log_softmax(-1)
                out.append(lp.gather(1, x[0, 1:, None])[:, 0])
        return out

    with_sinks = logprobs()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    return with_sinks, logprobs()


def deviation(a, b):
    """(mean, largest) absolute difference of two per-position log-probabilities."""
    d = (a - b).abs()
    return d.mean().item(), d.max().item()


def test_gpt_oss_with_every_key_exact_matches_triton_and_flash_attention(gpt_oss, tmp_path):
    """Sinks served as the model means them, on prefill: with a 64-token residual window
    (below the model's 128-token sliding window, as the backend requires) that holds every
    prompt (16-64 tokens) whole, CUSTOM reads every key exact, and the
    log-probability it gives each prompt token (prompt_logprobs: one forward, no sampling
    chain to reproduce) is TRITON_ATTN's and FLASH_ATTN's (both take the sinks): per
    prompt, its mean and largest deviation from each are within 3 times the references'
    from each other, or 0.05 and 1.5 nats where those are smaller (one position's expert
    choice may flip on bf16 rounding). CUSTOM runs twice: each prompt in one step, and in
    chunks of 32 tokens, whose queries read the earlier keys from the window store.
    Controls, per prompt, from transformers' float32 forward on the CPU: ignoring the
    sinks changes the log-probabilities by a mean of more than 4 times the mean tolerance
    (so a CUSTOM that dropped them fails), and each reference is within a quarter of that
    change of transformers (so the references compute this model, sinks included)."""
    model, _ = gpt_oss
    # no K/V maps: window rows then meet the same arithmetic as the references'
    books = random_codebooks(str(tmp_path / "b.safetensors"), model, 32, seed=1)
    ids = gpt_oss_prompts(model, range(16, 65, 8), seed=2)
    pq = {"additional_config": {"pq": {"codebooks": books, "window": 64}}}
    runs = {
        "TRITON_ATTN": gpt_oss_run(model, "TRITON_ATTN", ids),
        "FLASH_ATTN": gpt_oss_run(model, "FLASH_ATTN", ids),
        "CUSTOM": gpt_oss_run(model, "CUSTOM", ids, **pq),
        "CUSTOM, chunks of 32": gpt_oss_run(model, "CUSTOM", ids, max_num_batched_tokens=32,
                                            **pq),
    }
    lps = {name: [lp for lp, _ in out] for name, out in runs.items()}
    hf, no_sinks = gpt_oss_transformers(model, ids)
    refs = ("TRITON_ATTN", "FLASH_ATTN")
    problems = []
    for i, p in enumerate(ids):
        noise = deviation(lps["TRITON_ATTN"][i], lps["FLASH_ATTN"][i])
        tol = (max(3 * noise[0], 0.05), max(3 * noise[1], 1.5))
        sinks = deviation(hf[i], no_sinks[i])
        line = (f"prompt {i} ({len(p)} tokens), mean / largest: references apart "
                f"{noise[0]:.3f} / {noise[1]:.3f}, tolerance {tol[0]:.3f} / {tol[1]:.3f}; "
                f"ignoring the sinks changes {sinks[0]:.3f} / {sinks[1]:.3f}")
        if 4 * tol[0] >= sinks[0]:
            problems.append(f"prompt {i}: the tolerance cannot tell the sinks")
        for ref in refs:
            off = deviation(lps[ref][i], hf[i])
            line += f"; {ref} from transformers {off[0]:.3f} / {off[1]:.3f}"
            if 4 * off[0] >= sinks[0]:
                problems.append(f"prompt {i}: {ref} is not the model transformers computes")
        for name in ("CUSTOM", "CUSTOM, chunks of 32"):
            for ref in refs:
                dev = deviation(lps[name][i], lps[ref][i])
                line += f"; {name} from {ref} {dev[0]:.3f} / {dev[1]:.3f}"
                if dev[0] > tol[0] or dev[1] > tol[1]:
                    problems.append(f"prompt {i}: {name} is off {ref}")
        print(line)
    assert not problems, problems


def test_gpt_oss_through_codes_stays_near_bf16(gpt_oss):
    """Sinks with codes: 600-token prompts, past the 64-token window, the 128-token
    sliding window and four pages, read through the calibrated 4-bit codes. The prompts'
    log-probabilities are finite at every position; per prompt their mean deviation from
    FLASH_ATTN's bf16 is under half of what ignoring the sinks changes (transformers,
    float32, on the CPU: a perplexity barely moves without the sinks, the per-position
    log-probabilities do), and the perplexity is within 20% of FLASH_ATTN's. FLASH_ATTN
    itself is the model: within a quarter of that change of transformers. Greedy
    continuations (32 tokens, the decode path): no prompt gives one repeated token where
    FLASH_ATTN does not. Perplexity and agreement with bf16 are printed for the log."""
    model, books = gpt_oss
    ids = gpt_oss_prompts(model, [600] * 4, seed=1)  # text like the calibration's, not seen by it
    runs = {"FLASH_ATTN": gpt_oss_run(model, "FLASH_ATTN", ids, max_tokens=32),
            "CUSTOM": gpt_oss_run(model, "CUSTOM", ids, max_tokens=32, additional_config={
                "pq": {"codebooks": books, "window": 64}})}
    lps = {name: [lp for lp, _ in out] for name, out in runs.items()}
    tokens = {name: [t for _, t in out] for name, out in runs.items()}
    for name, x in lps.items():
        assert all(torch.isfinite(lp).all() for lp in x), name
    hf, no_sinks = gpt_oss_transformers(model, ids)
    nll = {name: -torch.cat(x).mean().item() for name, x in lps.items()}
    ratio = math.exp(nll["CUSTOM"] - nll["FLASH_ATTN"])
    same = sum(a == b for x, y in zip(tokens["CUSTOM"], tokens["FLASH_ATTN"])
               for a, b in zip(x, y)) / sum(len(x) for x in tokens["CUSTOM"])
    print(f"gpt-oss shape, 4 bits: perplexity {math.exp(nll['CUSTOM']):.1f} vs bf16 "
          f"{math.exp(nll['FLASH_ATTN']):.1f} ({ratio - 1:+.2%}); greedy tokens equal at the "
          f"same position: {same:.1%}")
    problems = []
    for i in range(len(ids)):
        sinks = deviation(hf[i], no_sinks[i])[0]
        codes = deviation(lps["CUSTOM"][i], lps["FLASH_ATTN"][i])
        bf16 = deviation(lps["FLASH_ATTN"][i], hf[i])[0]
        print(f"prompt {i}, mean / largest: CUSTOM from FLASH_ATTN {codes[0]:.3f} / "
              f"{codes[1]:.3f}; FLASH_ATTN from transformers {bf16:.3f}; ignoring the sinks "
              f"changes {sinks:.3f}\n  greedy FLASH_ATTN {tokens['FLASH_ATTN'][i]}"
              f"\n  greedy CUSTOM     {tokens['CUSTOM'][i]}")
        if 4 * bf16 >= sinks:
            problems.append(f"prompt {i}: FLASH_ATTN is not the model transformers computes")
        if 2 * codes[0] >= sinks:
            problems.append(f"prompt {i}: CUSTOM's codes move it as far as dropping the sinks")
        if len(set(tokens["CUSTOM"][i])) == 1 < len(set(tokens["FLASH_ATTN"][i])):
            problems.append(f"prompt {i}: CUSTOM repeats one token, FLASH_ATTN does not")
    assert not problems, problems
    assert abs(ratio - 1) < 0.2


# Qwen3 (QK-norm)


def test_qwen3_exact_window_matches_triton_attn_and_codes_serve(tmp_path, monkeypatch):
    """A QK-norm model served: the tiny random Qwen3 of tests/test_qwen3.py (Qwen3-8B's
    attention: head_dim 128, 32 query / 8 KV heads), batch-invariant eager mode, bfloat16.
    Window 128 holds every prompt and output token, so every key CUSTOM reads is exact, and
    batch-invariant CUSTOM attends with vLLM's Triton unified attention as TRITON_ATTN does
    (codebooks without maps, so no query or key is mapped): greedy outputs equal
    TRITON_ATTN's. FLASH_ATTN (FlashAttention 3, other arithmetic) is printed beside them.
    Then window 0 with codebooks calibrated on the model (4 bits per element, --window 0):
    every key and value read through codes, every sampled token's logprob finite and no
    output one repeated token."""
    from test_qwen3 import text, tiny_qwen3
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model = tiny_qwen3(tmp_path / "model")
    exact_books = random_codebooks(str(tmp_path / "random.safetensors"), model, 64, seed=1)
    (tmp_path / "a.txt").write_text(text(0, 4000))
    coded_books = str(tmp_path / "calibrated.safetensors")
    # its own process: an engine started in batch-invariant mode replaces torch's matmuls
    # in this one for good, with kernels that take no float64
    subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", "--model", model,
                    "--text", str(tmp_path / "a.txt"), "--bits", "4", "--tokens", "4000",
                    "--samples", "4000", "--seq-len", "512", "--window", "0", "--device", "cuda",
                    "--out", coded_books], check=True)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                  gpu_memory_utilization=0.15, max_num_seqs=8, seed=0)

    def run(backend, **pq):
        extra = {"additional_config": {"pq": pq}} if pq else {}
        llm = LLM(attention_backend=backend, **common, **extra)
        out = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        del llm
        settle()
        return out

    custom = run("CUSTOM", codebooks=exact_books, window=128)
    assert all(len(o.token_ids) == 40 for o in custom)
    assert [o.token_ids for o in custom] == [o.token_ids for o in run("TRITON_ATTN")]
    flash = run("FLASH_ATTN")
    same = [sum(a == b for a, b in zip(c.token_ids, f.token_ids)) for c, f in zip(custom, flash)]
    print(f"Qwen3, window 128: greedy tokens equal to FLASH_ATTN's per prompt: {same} of 40")

    coded = run("CUSTOM", codebooks=coded_books, window=0)
    for o in coded:
        lps = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
        assert len(lps) == 40 and all(math.isfinite(x) for x in lps), lps
        assert len(set(o.token_ids)) > 1, o.token_ids


# Speculative decoding: the targets and configs eval/speculative.py uses, at two layers of
# test_speculative.SMALL


def speculation_keeps_greedy_outputs(model, books, window, prompts, max_tokens,
                                     speculative_config, name, accepted=False, **kw):
    """Greedy outputs of the tiny target on CUSTOM with ``speculative_config`` are those
    without, and the draft proposed tokens, so verification ran. Outputs that degenerate
    fail (greedy), against which any engine is "identical" and every n-gram draft accepted;
    test_speculative.test_redrawn_tiny_targets_give_varied_greedy_outputs checks the drawn
    weights' outputs on the CPU. vLLM's counters are printed; with ``accepted`` some drafts must have been accepted (n-gram drafts copy the
    context, a random EAGLE or MTP draft is rarely right)."""
    plain = engine(model, books, window, **kw)
    want = greedy(plain, prompts, max_tokens)
    del plain
    settle()
    spec = engine(model, books, window, disable_log_stats=False,
                  speculative_config=speculative_config, **kw)
    assert greedy(spec, prompts, max_tokens) == want
    names = [f"vllm:spec_decode_num_{n}" for n in ("drafts", "draft_tokens", "accepted_tokens")]
    metrics = {m.name: m.value for m in spec.get_metrics() if m.name in names}
    print(f"{name} on CUSTOM:", metrics)
    assert metrics.get("vllm:spec_decode_num_draft_tokens", 0) > 0
    assert "vllm:spec_decode_num_accepted_tokens" in metrics
    if accepted:
        assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_eagle3_speculation_keeps_greedy_outputs(tmp_path, monkeypatch):
    """Batch-invariant eager mode: greedy outputs of a tiny Llama-3-shaped target (two
    layers, head_dim 64, random 4-bit codebooks) with a one-layer EAGLE-3 draft of dummy
    weights (3 tokens; its layer on FLASH_ATTN with dense KV next to the target's PQ
    pages) are those without. Token-id prompts of 96-160 tokens, past the 32-token
    window."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model, books = tiny_target(tmp_path / "model", "eagle3")
    draft = spec_eval.eagle3_draft(model, tmp_path / "draft")
    speculation_keeps_greedy_outputs(model, books, 32, IDS, MAX_TOKENS,
                                     spec_eval.speculative_config("eagle3", 3, draft), "EAGLE-3",
                                     async_scheduling=False)


def test_mtp_speculation_keeps_greedy_outputs(tmp_path, monkeypatch):
    """Batch-invariant eager mode: greedy outputs of a tiny MiMo (two layers, head_dim 64,
    random 4-bit codebooks) with its MTP layer drafting 3 tokens (on FLASH_ATTN, dense KV
    next to the target's PQ pages) are those without. Token-id prompts of 96-160 tokens,
    past the 32-token window."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model, books = tiny_target(tmp_path / "model", "mtp")
    speculation_keeps_greedy_outputs(model, books, 32, IDS, MAX_TOKENS,
                                     spec_eval.speculative_config("mtp", 3), "MTP",
                                     async_scheduling=False)
