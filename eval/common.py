"""What the scripts in eval/ share: the provenance every recorded result carries (device,
versions, git commit, command, date; codebook hash and bits where a run has codebooks),
text documents as token ids, perplexity through vLLM's prefill, and a model folder of
Llama-3-8B's shape with random codebooks for timing.

The scripts run as ``python eval/NAME.py``, so this folder is on ``sys.path`` and they
import from here as ``from common import ...``.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile

# --- provenance ------------------------------------------------------------------------


def git_commit() -> str:
    """PQ_GIT_COMMIT when the launcher exported it (a copied tree may carry a .git that is
    not the one the code came from); else HEAD of the checkout, ``+dirty`` with
    uncommitted changes."""
    if os.environ.get("PQ_GIT_COMMIT"):
        return os.environ["PQ_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def provenance(device: str | None = None) -> dict:
    """``device``: a description for runs off the GPU; default the CUDA device's name."""
    import torch

    return dict(
        device=device or torch.cuda.get_device_name(),
        vllm=_version("vllm"), torch=torch.__version__, transformers=_version("transformers"),
        git_commit=git_commit(),
        command="python " + " ".join(sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def write_result(path: str, result: dict) -> None:
    """A run's JSON (its rows stamped with provenance()) into ``path``, and say so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def size(n: float) -> str:
    """Bytes as GiB (3 decimals) from 1 GiB up, else MiB (1 decimal)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def save_section(path: str, name: str, section: dict) -> None:
    """``section`` as model ``name``'s in ``path``'s ``models``, other models' sections kept
    (runs of other models may finish at the same time: the file is read and written under
    a lock)."""
    import fcntl

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.load(open(path)) if os.path.exists(path) else {}
        models = data.get("models", {})
        models[name] = section
        with open(path, "w") as f:
            json.dump(dict(models=models), f, indent=1)
    print(f"wrote {path}")


def append_rows(path: str, rows: list[dict]) -> None:
    """``rows`` into ``path``'s list in place of any earlier rows of the same backends (the
    benchmarks that run one backend per process)."""
    old = json.load(open(path))["rows"] if os.path.exists(path) else []
    keep = [r for r in old if r["backend"] not in {x["backend"] for x in rows}]
    write_result(path, {"rows": keep + rows})


def codebook_meta(path):
    """bits, M, method and hash of a codebook file, for the rows it produces."""
    from vllm_pq_backend import codebooks
    from vllm_pq_backend.config import layers_of_m
    from vllm_pq_backend.layout import bits_of

    info = codebooks.read_info(path)
    cal = codebooks.calibration_of(info)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    by_layer = {}  # where K's or V's bits differ by layer: each layer's, and the exceptions
    for part, ms in (("k", info.m_k_layers), ("v", info.m_v_layers)):
        base = codebooks.base_m(ms)
        differ = {bits_of(info.head_dim, m): runs for m, runs in layers_of_m(ms, base).items()}
        if differ:
            by_layer.update({f"m_{part}_layers": list(ms), f"{part}_layers": differ,
                             f"bits_{part}_base": bits_of(info.head_dim, base)})
    return dict(m_k=info.m_k, m_v=info.m_v, head_dim=info.head_dim, **by_layer,
                bits_k=info.bits_k, bits_v=info.bits_v, codebook_sha256=digest,
                codebook_file=os.path.abspath(path),
                method="plain" if not info.transforms and not cal.get("method") else
                json.dumps(cal.get("method"), sort_keys=True),
                calib_text=cal.get("texts"), calib_tokens=cal.get("tokens"),
                calib_seq_len=cal.get("seq_lens") or cal.get("seq_len"),
                calib_pack=bool(cal.get("pack")),
                calib_model_context=cal.get("model_context"),
                calib_samples=cal.get("samples_per_head"), calib_seed=cal.get("seed"),
                **{key: cal[key] for key in ("bits_mean", "bits_v_mean") if key in cal},
                **({"k_fit": cal["k_fit"]["chosen"]} if "k_fit" in cal else {}))


# --- servers --------------------------------------------------------------------------


def wait_healthy(port: int, proc, timeout: float) -> float | None:
    """Seconds until the server on ``port`` answers /health with 200; None if its process
    ``proc`` exits or ``timeout`` passes first."""
    import time
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(1)
    return None


def gpu_apps() -> dict[int, int] | None:
    """{pid: MiB} of the compute processes nvidia-smi lists; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {int(p): int(m) for p, m in (line.split(",") for line in out.splitlines() if line.strip())}


# --- codebooks ---------------------------------------------------------------------------

CALIB_TOKENS = 65536  # calibrate's default


def calibration(meta: dict) -> str:
    """How a codebook file was calibrated (codebook_meta's fields), where it is not
    calibrate's default (packed sequences as long as the model's context, at most the
    tokens run, seed 0): ", calibrated on 512K tokens in 8K-token packed sequences", ",
    calibrated with seed 1", or "". A list of sequence lengths (calibrate --seq-len 2048 8192)
    is never the default."""
    tokens = meta.get("calib_tokens") not in (None, CALIB_TOKENS)
    context = meta.get("calib_model_context")  # recorded by calibrate since it packs by default
    seqs = meta.get("calib_seq_len") is not None and not (
        isinstance(meta["calib_seq_len"], int) and meta.get("calib_pack") and context
        and meta["calib_seq_len"] == min(context, meta.get("calib_tokens") or CALIB_TOKENS))
    seed = f" with seed {meta['calib_seed']}" if meta.get("calib_seed") else ""
    if not tokens and not seqs:
        return seed and ", calibrated" + seed
    return ", calibrated on " + calibration_words(meta["calib_tokens"] if tokens else None,
                                                  meta["calib_seq_len"] if seqs else None,
                                                  meta.get("calib_pack")) + seed


def exact_words(meta: dict) -> str:
    """The exact store of an engine's pages (meta: custom_engines'), or "": " + 2 exact
    per page (4.31 bits)", the bits per element of K and V with the store's bytes.
    (accuracy_sim's rows name by "exact" a simulated store's spec string: not this.)"""
    if not isinstance(meta.get("exact"), int) or not meta["exact"]:
        return ""
    bits = (meta["bits_k_total"] + meta["bits_v_total"]) / 2
    return f" + {meta['exact']} exact per page ({bits:.2f} bits)"


def engine_label(meta: dict, window: int) -> str:
    """CUSTOM by bits per element, exact store and window, and its calibration where not
    the default."""
    return (f"CUSTOM K{meta.get('bits_k_base', meta['bits_k'])}/"
            f"V{meta.get('bits_v_base', meta['bits_v'])} bits"
            + layer_bits_words(meta) + exact_words(meta)
            + (", K's training by layer" if meta.get("k_fit") else "")  # calibrate --fit-k
            + f" W={window}" + calibration(meta))


def layer_bits_words(meta: dict) -> str:
    """The layers whose K or V bits differ from the file's others (codebook_meta), or "":
    ", K 2 in layers 0-3, V 4 in layers 18-23"."""
    # as vllm_pq_backend.config.layers_words, which report.py (run without the package
    # installed) cannot import
    return "".join(f", {part.upper()} {b} in layer{'s' if any(c in r for c in ',-') else ''} {r}"
                   for part in "kv" for b, r in (meta.get(f"{part}_layers") or {}).items())


def layer_widths(meta: dict) -> list[tuple[int, int]]:
    """(Mk, Mv) of each layer of a codebook file (codebook_meta's fields)."""
    n = len(meta.get("m_k_layers") or meta.get("m_v_layers") or [0])
    return list(zip(meta.get("m_k_layers") or [meta["m_k"]] * n,
                    meta.get("m_v_layers") or [meta["m_v"]] * n))


def custom_engines(paths: list[str], windows: list[int], exacts: list[int],
                   block_size: int = 128) -> list[tuple[str, dict, dict]]:
    """(label, meta, LLM arguments) of a CUSTOM engine for every codebook file, window and
    exact store size (entries per page and KV head); meta adds to codebook_meta's the
    window, the store, the page's bytes per token and KV head (layout.PageLayout) and the
    bits per element of K and V with the store's bytes."""
    from vllm_pq_backend.layout import PageLayout

    out = []
    for path in paths:
        meta = codebook_meta(path)
        for w in windows:
            for p in exacts:
                lays = [PageLayout(block_size, mk, mv, meta["head_dim"], p)
                        for mk, mv in layer_widths(meta)]
                mean = lambda xs: sum(xs) / len(lays)  # noqa: E731  (over the layers)
                bk, bv = (mean(x) for x in zip(*(lay.bits() for lay in lays)))
                m = dict(meta, window=w, exact=p,
                         page_bytes=round(mean([lay.state_bytes for lay in lays]), 4),
                         bits_k_total=round(bk, 4), bits_v_total=round(bv, 4))
                out.append((engine_label(m, w), m, dict(
                    attention_backend="CUSTOM", block_size=block_size,
                    additional_config={"pq": {"codebooks": path, "window": w, "exact": p}})))
    return out


def calibration_words(tokens: int | None, seq_len: int | list[int] | None, pack: bool) -> str:
    """"512K tokens in 8K-token packed sequences" ("2K- and 8K-token", "2K-, 4K- and
    8K-token" for a list of lengths), either part left out where None."""
    words = [f"{tokens // 1024}K tokens"] if tokens else []
    if seq_len:
        lens = [f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"
                for n in ([seq_len] if isinstance(seq_len, int) else seq_len)]
        both = lens[0] if len(lens) == 1 else "-, ".join(lens[:-1]) + "- and " + lens[-1]
        words.append(f"{both}-token {'packed ' if pack else ''}sequences")
    return " in ".join(words)


# --- text and perplexity ---------------------------------------------------------------


# position buckets of the long-context measurements: (first, last + 1) token positions
POSITION_BUCKETS = ((0, 2048), (2048, 4096), (4096, 8192), (8192, 16384), (16384, 32768))


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo // 1024}-{hi // 1024}K"


def load_docs(path, tokenizer, max_len, n_docs):
    """``n_docs`` documents of a .jsonl file ({"text": ...} per line) spread evenly over
    it (its order is by topic), BOS first, cut at ``max_len`` tokens."""
    docs = [json.loads(line)["text"] for line in open(path)]
    step = max(1, len(docs) // n_docs)
    return [([tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False)["input_ids"])[:max_len]
            for t in docs[::step][:n_docs]]


def prompt_perplexity(llm, docs) -> tuple[float, int]:
    """(token perplexity, scored tokens) of token-id documents through vLLM's prefill."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for d, o in zip(docs, outs):
        for tok, lp in zip(d[1:], o.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            count += 1
    return math.exp(nll / count), count


# --- a model of Llama-3-8B's shape for timing ------------------------------------------

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "tie_word_embeddings": False,
}


def write_model_dir(d: str, ms, maps: bool = False, config: dict = LLAMA3_8B) -> str:
    """``config`` (default Llama-3-8B's shape) as config.json in ``d``, and random codebooks
    for CUSTOM with each M of ``ms`` (speed does not depend on what the centroids are); serve it with
    ``load_format="dummy"``. With ``maps`` the codebooks carry K and V maps, as
    ``calibrate`` writes them by default: random rotations, so that the query / key /
    value / output maps run as with calibrated codebooks while the store sees rows
    distributed as without maps (speed does not depend on the maps' values)."""
    import torch
    from transformers import AutoConfig

    from vllm_pq_backend.codebooks import head_dim_of, save_codebooks
    from vllm_pq_backend.config import default_codebook_path

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = AutoConfig.from_pretrained(d)  # as vLLM reads it, so the codebooks' fingerprint matches
    head_dim = head_dim_of(cfg)
    g = torch.Generator().manual_seed(0)
    for m in ms:
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, m, 256, head_dim // m)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        rotations = {}
        if maps:
            for name in ("k_transform", "v_transform"):
                rotations[name] = torch.linalg.qr(torch.randn(*shape[:2], head_dim, head_dim,
                                                              generator=g))[0].contiguous()
        save_codebooks(default_codebook_path(d, m), k, v, cfg, {"model": "random (benchmark)"},
                       **rotations)
    return d


def make_model_dir(m: int, maps: bool = False) -> str:
    """A temporary Llama-3-8B-shaped model folder with random codebooks of M ``m``."""
    return write_model_dir(tempfile.mkdtemp(prefix="llama3-8b-shape-"), [m], maps)


def engine_backend(backend: str, m: int, maps: bool = False) -> tuple[dict, str]:
    """`LLM` keyword arguments that pick ``backend``, and its rows' name (CUSTOM by bits
    per element: ``m`` subspaces of head_dim 128; ", maps" where its codebooks have them)."""
    from vllm_pq_backend.layout import bits_of

    if backend == "CUSTOM":
        return (dict(attention_backend="CUSTOM", additional_config={"pq": {"m": m}}),
                f"CUSTOM {bits_of(128, m)} bits" + (", maps" if maps else ""))
    if backend == "TURBOQUANT":
        return dict(kv_cache_dtype="turboquant_4bit_nc"), "TURBOQUANT 4bit_nc"
    return dict(attention_backend=backend), backend
