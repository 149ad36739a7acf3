"""Long-context quality in vLLM, every KV cache side by side in one run: fidelity by distance
and retrieval at distance, on a real model.

    python eval/long_context.py --model eval/data/smollm2 --model-name SmolLM2-135M \
        --lengths 2048 4096 8192 \
        --codebooks eval/data/smollm2/pq/codebooks_m32.safetensors \
                    eval/data/smollm2/pq/codebooks_m32_v16.safetensors \
                    eval/data/smollm2/pq/codebooks_m16.safetensors

*Fidelity by distance*: documents of real text concatenated to the model's context, scored
through ``prompt_logprobs``; per position bucket (0-2K, 2-4K, 4-8K, 8-16K, 16-32K) the
perplexity of each cache and the share of positions whose top-1 prediction equals bf16's.

*Retrieval at distance*: seeded prompts over a haystack of real text, the same token ids for
every cache (paired; their hash is recorded), greedy answers:
  passkey   a 5-7 digit key at a depth of 0-100%, asked for at the end;
  multikey  four "special magic number for WORD" needles at random depths, one asked for
            (its depth spread over 0-100%);
  verbatim  the first words of a sentence that appeared at a given depth, continued: the next
            six words must come back exactly.

Every row names its cache by bits per element (K and V). Text for both parts comes from files
the codebooks never saw (``--fidelity-text``, ``--haystack``). Results go to ``--out`` under the
model's name (other models' sections are kept), with a plot beside it. ``--lm-eval-data DIR``
also writes the retrieval prompts as text for the offline lm-eval tasks in eval/lm_eval/
(``pq_long``), the third entry point on the same work.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time

from common import (POSITION_BUCKETS, bucket_name,  # eval/ is the script's directory
                    custom_engines, provenance, save_section)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the engine's KV size

BASELINES = {  # name -> LLM(...) arguments
    "FLASH_ATTN bf16": dict(attention_backend="FLASH_ATTN"),
    "fp8": dict(kv_cache_dtype="fp8"),
    "TURBOQUANT 4bit_nc": dict(kv_cache_dtype="turboquant_4bit_nc"),
}
REFERENCE = "FLASH_ATTN bf16"
ANSWER_ROOM = 64  # tokens a prompt leaves below its nominal length for the answer
TOKENIZE_SLACK = 0.05
MAX_TOKENS = {"passkey": 16, "multikey": 16, "verbatim": 24}


def _task_scoring():
    """The lm-eval tasks' scoring module (eval/lm_eval/pq_long_utils.py), the one home of the
    answer rule, loaded by path as lm-eval loads it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval", "pq_long_utils.py")
    spec = importlib.util.spec_from_file_location("pq_long_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCORING = _task_scoring()
TASKS = SCORING.TASKS
VERBATIM_PROBE, VERBATIM_TARGET = 10, SCORING.VERBATIM_TARGET  # words shown, words that must follow
WORDS = ("apple", "river", "candle", "mirror", "garden", "violin", "harbor", "pepper",
         "lantern", "meadow", "falcon", "saddle", "copper", "island", "thunder", "basket",
         "marble", "forest", "pillow", "rocket", "window", "tunnel", "velvet", "walnut",
         "anchor", "blanket", "cactus", "dolphin", "engine", "feather", "glacier", "hammer")
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it. I will quiz you about it.")
MULTIKEY_INTRO = ("Some special magic numbers are hidden inside the following text. Make sure to "
                  "memorize them. I will quiz you about one of them.")
VERBATIM_INTRO = "Read the following text carefully. Parts of it will be quoted again later."


def read_paragraphs(paths: list[str]) -> list[str]:
    """Paragraphs (blank-line separated, at least 40 characters) of JSONL documents, in order."""
    paras = []
    for path in paths:
        for line in open(path, encoding="utf-8"):
            for p in json.loads(line)["text"].split("\n\n"):
                p = p.strip()
                if len(p) >= 40:
                    paras.append(p)
    return paras


class Text:
    """A tokenizer and the paragraphs of one corpus, each tokenized once: prompts are joined
    from token ids (pieces separated by the ids of a blank line), so that their lengths are
    exact without tokenizing each prompt again."""

    def __init__(self, tok, paths: list[str]):
        self.tok = tok
        self.paras = read_paragraphs(paths)
        self.ids = self.encode_many(self.paras)
        self.sep = self.encode_many(["\n\n"])[0]
        self.bos = [tok.bos_token_id] if tok.bos_token_id is not None else []

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def run(self, rng: random.Random, tokens: int) -> list[int]:
        """Indices of consecutive paragraphs from a random start, as many as fit ``tokens``
        (separators counted)."""
        i, out, total = rng.randrange(len(self.paras)), [], 0
        while total + len(self.ids[i]) + len(self.sep) <= tokens:
            out.append(i)
            total += len(self.ids[i]) + len(self.sep)
            i = (i + 1) % len(self.paras)
        return out

    def join(self, pieces: list[tuple[str, list[int]]]) -> tuple[str, list[int]]:
        """(text, token ids with BOS first) of pieces given as (text, ids)."""
        ids = list(self.bos)
        for k, (_, p) in enumerate(pieces):
            ids += (self.sep if k else []) + p
        return "\n\n".join(t for t, _ in pieces), ids


def _digits(rng: random.Random) -> str:
    n = rng.randint(5, 7)
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def make_sample(text: Text, task: str, length: int, depth: float, rng: random.Random) -> dict:
    """One prompt of ``task`` of at most ``length - ANSWER_ROOM`` tokens; ``depth`` places the
    asked needle (or the quoted sentence) in the haystack, 0 first, 1 last. The recorded depth
    is the share of the haystack's tokens before it."""
    if task == "passkey":
        key = _digits(rng)
        intro, answer = PASSKEY_INTRO, key
        needles = [(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")]
        question = "What is the pass key? The pass key is"
    elif task == "multikey":
        words = rng.sample(WORDS, 4)
        nums = [_digits(rng) for _ in words]
        intro, answer = MULTIKEY_INTRO, nums[0]
        needles = [(depth, f"The special magic number for {words[0]} is: {nums[0]}.")] + [
            (rng.random(), f"The special magic number for {w} is: {n}.") for w, n in zip(words[1:], nums[1:])]
        question = (f"What is the special magic number for {words[0]}? The special magic "
                    f"number for {words[0]} is:")
    elif task == "verbatim":
        intro, needles, question = VERBATIM_INTRO, [], None
    else:
        raise ValueError(task)
    fixed = [intro] + [n for _, n in needles] + ([question] if question else [])
    fixed_ids = dict(zip(fixed, text.encode_many(fixed)))
    room = length - ANSWER_ROOM - len(text.bos) - sum(len(i) + len(text.sep) for i in fixed_ids.values())
    if task == "verbatim":
        room -= 48  # the quoted words at the end
    # the prompt's text, tokenized whole (as lm-eval does), runs a few percent longer than its
    # pieces' ids (a blank line is one token between pieces, often two inside a text)
    hay = text.run(rng, int(room * (1 - TOKENIZE_SLACK)))
    starts = [0]  # tokens of the haystack before each paragraph
    for i in hay:
        starts.append(starts[-1] + len(text.ids[i]) + len(text.sep))
    pieces = [(text.paras[i], text.ids[i]) for i in hay]
    if task == "verbatim":
        body = "\n\n".join(text.paras[i] for i in hay)
        k = round(depth * (len(hay) - 1))
        # the nearest paragraph (from depth outwards) with a run of words whose first words
        # occur once in the whole haystack
        for j in sorted(range(len(hay)), key=lambda j: (abs(j - k), j)):
            words = text.paras[hay[j]].split()
            found = None
            for s in range(0, len(words) - VERBATIM_PROBE - VERBATIM_TARGET + 1, VERBATIM_PROBE):
                probe = " ".join(words[s : s + VERBATIM_PROBE])
                if body.count(probe) == 1:
                    found = probe, " ".join(words[s + VERBATIM_PROBE : s + VERBATIM_PROBE + VERBATIM_TARGET])
                    break
            if found:
                break
        else:
            raise ValueError("no quotable sentence in the haystack")
        probe, answer = found
        at = starts[j] / starts[-1]
        prompt, ids = text.join([(intro, fixed_ids[intro])] + pieces
                                + [(probe, text.encode_many([probe])[0])])
    else:
        at = None
        for d, needle in sorted(needles, key=lambda x: -x[0]):  # from the back: indices hold
            k = round(d * len(pieces))
            pieces.insert(k, (needle, fixed_ids[needle]))
            if needle == needles[0][1]:
                at = starts[k] / starts[-1] if starts[-1] else 0.0
        prompt, ids = text.join([(intro, fixed_ids[intro])] + pieces + [(question, fixed_ids[question])])
    return dict(task=task, length=length, depth=round(at, 4), prompt=prompt, answer=answer, ids=ids)


def make_samples(text: Text, tasks, lengths, n: int, seed: int) -> list[dict]:
    """``n`` samples per (task, length), depths evenly over 0..1, seeded per (task, length)."""
    out = []
    for task in tasks:
        for length in lengths:
            rng = random.Random(f"{seed}/{task}/{length}")
            for i in range(n):
                out.append(make_sample(text, task, length, i / max(1, n - 1), rng))
    return out


def fidelity_docs(text: Text, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token-id documents of ``length`` tokens: BOS, then consecutive paragraphs from a
    seeded start."""
    rng = random.Random(f"{seed}/fidelity")
    docs = []
    for _ in range(n):
        _, ids = text.join([(text.paras[i], text.ids[i]) for i in text.run(rng, length + 64)])
        docs.append(ids[:length])
    return docs


def run_engine(kw: dict, args, docs, samples) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enforce_eager=True, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              **kw)
    cc = llm.llm_engine.vllm_config.cache_config
    res = dict(kv_cache_tokens=cc.num_gpu_blocks * cc.block_size, nll=[], top1=[])
    if docs:
        outs = llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs],
                            SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False,
                                           flat_logprobs=True), use_tqdm=False)
        for d, o in zip(docs, outs):
            lps = o.prompt_logprobs
            nll, top1 = [], []
            for pos in range(1, len(d)):
                lo, hi = lps.start_indices[pos], lps.end_indices[pos]
                ids, vals, ranks = (lps.token_ids[lo:hi], lps.logprobs[lo:hi], lps.ranks[lo:hi])
                nll.append(-vals[ids.index(d[pos])])
                top1.append(ids[ranks.index(1)])
            res["nll"].append(nll)
            res["top1"].append(top1)
    t1 = time.time()
    res["fidelity_seconds"] = round(t1 - t0, 1)
    if samples:
        params = {t: SamplingParams(max_tokens=MAX_TOKENS[t], temperature=0.0) for t in TASKS}
        outs = llm.generate([TokensPrompt(prompt_token_ids=s["ids"]) for s in samples],
                            [params[s["task"]] for s in samples], use_tqdm=False)
        res["outputs"] = [o.outputs[0].text for o in outs]
    res["retrieval_seconds"] = round(time.time() - t1, 1)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def fidelity_rows(label: str, res: dict, ref: dict | None) -> list[dict]:
    rows = []
    for lo, hi in POSITION_BUCKETS:
        nll, agree, count, ref_nll = 0.0, 0, 0, 0.0
        for d, doc in enumerate(res["nll"]):
            for pos in range(max(1, lo), min(hi, len(doc) + 1)):
                nll += doc[pos - 1]
                count += 1
                if ref is not None:
                    ref_nll += ref["nll"][d][pos - 1]
                    agree += res["top1"][d][pos - 1] == ref["top1"][d][pos - 1]
        if not count:
            continue
        row = dict(engine=label, bucket=bucket_name(lo, hi), tokens=count,
                   ppl=round(math.exp(nll / count), 4))
        if ref is not None:
            row["ppl_bf16"] = round(math.exp(ref_nll / count), 4)
            row["delta_pct"] = round(100 * (math.exp((nll - ref_nll) / count) - 1), 3)
            row["top1_agreement"] = round(agree / count, 5)
        rows.append(row)
    return rows


def retrieval_rows(label: str, res: dict, samples, ref_correct: dict | None) -> tuple[list, dict]:
    """Accuracy per (task, length), paired with bf16's where ``ref_correct`` is given; and
    this cache's correct answers by (task, length)."""
    correct: dict[tuple, list[bool]] = {}
    for s, out in zip(samples, res["outputs"]):
        correct.setdefault((s["task"], s["length"]), []).append(SCORING.correct(s["task"], s["answer"], out))
    rows = []
    for (task, length), c in correct.items():
        row = dict(engine=label, task=task, length=length, n=len(c),
                   accuracy=round(100 * sum(c) / len(c), 2),
                   correct="".join("1" if x else "0" for x in c))
        if ref_correct is not None:
            r = ref_correct[(task, length)]
            row["accuracy_bf16"] = round(100 * sum(r) / len(r), 2)
            row["delta_points"] = round(row["accuracy"] - row["accuracy_bf16"], 2)
            row["only_bf16"] = sum(a and not b for a, b in zip(r, c))  # the discordant pairs
            row["only_this"] = sum(b and not a for a, b in zip(r, c))
        rows.append(row)
    return rows, correct


def plot(section: dict, path: str) -> None:
    """One row of panels per model: retrieval accuracy by length per task, then the
    perplexity change and top-1 agreement with bf16 by position bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(section)
    fig, axes = plt.subplots(len(models), len(TASKS) + 2, figsize=(4 * (len(TASKS) + 2), 3.6 * len(models)),
                             squeeze=False)
    labels = list(dict.fromkeys(e["label"] for sec in section.values() for e in sec["engines"]))
    color = {e: f"C{i % 10}" for i, e in enumerate(labels)}  # one colour per cache in every panel
    for ax_row, name in zip(axes, models):
        sec = section[name]
        engines = [e["label"] for e in sec["engines"]]
        for ax, task in zip(ax_row, TASKS):
            for e in engines:
                rows = sorted((r for r in sec["retrieval"] if r["engine"] == e and r["task"] == task),
                              key=lambda r: r["length"])
                if rows:
                    ax.plot([r["length"] for r in rows], [r["accuracy"] for r in rows], marker="o",
                            label=e, color=color[e])
            ax.set_xscale("log", base=2)
            ax.set_ylim(-2, 102)
            ax.set_title(f"{name}: {task}")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("accuracy (%)")
        buckets = [bucket_name(*b) for b in POSITION_BUCKETS]
        for ax, key, ylabel in ((ax_row[-2], "delta_pct", "perplexity vs bf16 (%)"),
                                (ax_row[-1], "top1_agreement", "top-1 agreement with bf16")):
            for e in engines[1:]:
                rows = {r["bucket"]: r for r in sec["fidelity"]["rows"] if r["engine"] == e and key in r}
                xs = [b for b in buckets if b in rows]
                ax.plot(xs, [rows[b][key] for b in xs], marker="o", label=e, color=color[e])
            ax.set_title(f"{name}: {ylabel.split(' (')[0]}")
            ax.set_xlabel("position")
            ax.set_ylabel(ylabel)
        ax_row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--model-name", required=True, help="the model's section in --out")
    p.add_argument("--lengths", type=int, nargs="+", required=True,
                   help="nominal prompt lengths of the retrieval tasks (tokens)")
    p.add_argument("--codebooks", nargs="*", default=[], help="CUSTOM codebook files")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--exact", type=int, nargs="+", default=[0],
                   help="exact store entries per page and KV head (0: none), one engine each")
    p.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES))
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--samples", type=int, default=200, help="per (task, length)")
    p.add_argument("--fidelity-docs", type=int, default=16)
    p.add_argument("--fidelity-text", nargs="+", default=["eval/data/text/kernel.jsonl"])
    p.add_argument("--haystack", nargs="+",
                   default=["eval/data/text/fortunes.jsonl", "eval/data/text/heldout.jsonl"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV cache's size "
                   "instead of what memory profiling leaves (so other processes may share the GPU)")
    p.add_argument("--out", default="eval/results/long_context.json")
    p.add_argument("--lm-eval-data", help="also write the retrieval prompts as text here "
                   "(one JSONL per task) for eval/lm_eval's pq_long tasks")
    p.add_argument("--prompts-only", action="store_true", help="make the prompts (and "
                   "--lm-eval-data) and stop: no engine")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot of --out")
    p.add_argument("--gpus", nargs="+", default=None, metavar="ID", help="run the caches on "
                   "these GPUs at once, one worker process each (CUDA_VISIBLE_DEVICES=ID; same "
                   "engine settings on every GPU); a GPU named N times runs N workers, which "
                   "needs --kv-cache-memory-bytes")
    p.add_argument("--raw", help="each cache's raw results (default: beside --out, OUT_raw/); a "
                   "cache whose raw file is there is not run again, so a cut run resumes")
    p.add_argument("--engine", type=int, nargs="+", help=argparse.SUPPRESS)  # a worker's share
    args = p.parse_args()
    if args.gpus and len(set(args.gpus)) < len(args.gpus) and not args.kv_cache_memory_bytes:
        p.error("--gpus names a GPU twice: give --kv-cache-memory-bytes, since memory profiling "
                "cannot tell its engine's memory from that of the others on the GPU")
    if args.gpus and len(args.gpus) == 1:  # before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus[0]
    png = os.path.splitext(args.out)[0] + ".png"
    if args.plot_only:
        plot(json.load(open(args.out))["models"], png)
        return 0

    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = AutoConfig.from_pretrained(args.model)
    context = getattr(cfg.get_text_config(), "max_position_embeddings")
    if max(args.lengths) > context:
        sys.exit(f"long_context.py: --lengths up to {max(args.lengths)} exceed the model's "
                 f"context of {context} tokens")
    t0 = time.time()
    hay = Text(tok, args.haystack)
    samples = make_samples(hay, args.tasks, args.lengths, args.samples, args.seed)
    docs = fidelity_docs(Text(tok, args.fidelity_text), args.fidelity_docs, context - 1, args.seed) \
        if args.fidelity_docs else []
    digest = hashlib.sha256(json.dumps([s["ids"] for s in samples] + docs).encode()).hexdigest()[:16]
    print(f"{len(samples)} retrieval prompts, {len(docs)} fidelity documents of {context - 1} "
          f"tokens (prompt set {digest}, {time.time() - t0:.0f} s)", flush=True)
    if args.lm_eval_data:
        os.makedirs(args.lm_eval_data, exist_ok=True)
        for task in args.tasks:
            path = os.path.join(args.lm_eval_data, f"{task}.jsonl")
            with open(path, "w") as f:
                for s in (s for s in samples if s["task"] == task):
                    f.write(json.dumps({k: s[k] for k in ("task", "length", "depth", "prompt", "answer")}) + "\n")
            print(f"wrote {path}")
        check = samples[:: max(1, len(samples) // 50)]
        for s, ids in zip(check, hay.encode_many([s["prompt"] for s in check])):
            if len(hay.bos) + len(ids) > s["length"] - ANSWER_ROOM // 2:
                sys.exit(f"long_context.py: a {s['task']} prompt's text is {len(ids)} tokens, "
                         f"beyond its length {s['length']}: raise TOKENIZE_SLACK")
    if args.prompts_only:
        return 0
    args.max_model_len = args.max_model_len or max(
        [len(d) + 1 for d in docs] + [s["length"] for s in samples])

    engines = [(name, dict(method=name, bits_k=16 if "bf16" in name else None), kw)
               for name, kw in BASELINES.items() if name in args.baselines]
    if not engines or engines[0][0] != REFERENCE:
        sys.exit(f"long_context.py: {REFERENCE} is the reference: keep it in --baselines")
    engines += custom_engines(args.codebooks, [args.window], args.exact)
    labels = [label for label, _, _ in engines]
    if len(set(labels)) < len(labels):
        sys.exit(f"long_context.py: two caches share a label: {labels}")
    raw = args.raw or os.path.splitext(args.out)[0] + "_raw"
    os.makedirs(raw, exist_ok=True)

    def raw_path(i):  # one engine's raw results, named by what makes them
        key = hashlib.sha256(json.dumps([digest, labels[i], engines[i][1]], sort_keys=True,
                                        default=str).encode()).hexdigest()[:12]
        return os.path.join(raw, f"{key}.json")

    todo = [i for i in range(len(engines)) if not os.path.exists(raw_path(i))]
    if args.engine is not None:  # a worker: these engines, here
        todo = [i for i in args.engine if i in todo]
    if args.engine is None and args.gpus and len(args.gpus) > 1 and todo:
        # one worker process per entry (a GPU named twice runs two), each taking every
        # len(gpus)-th engine still to run
        procs = []
        for k, gpu in enumerate(args.gpus):
            mine = todo[k :: len(args.gpus)]
            if mine:
                cmd = [sys.executable] + sys.argv + ["--raw", raw, "--engine", *map(str, mine)]
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
                procs.append((mine, subprocess.Popen(cmd, env=env)))
        for mine, proc in procs:
            if proc.wait():
                print(f"long_context.py: the worker of engines {mine} exited with {proc.returncode}",
                      flush=True)
    else:
        import vllm_pq_backend  # noqa: F401  (the plugin registers itself through its entry point)

        for i in todo:
            label, meta, kw = engines[i]
            try:
                res = run_engine(kw, args, docs, samples)
            except Exception as e:  # e.g. a baseline that does not support this model: say so
                print(f"{label}: failed: {type(e).__name__}: {e}", flush=True)
                res = dict(error=f"{type(e).__name__}: {e}"[:2000])
            with open(raw_path(i), "w") as f:
                json.dump(res, f)
            print(f"{label}: done ({res.get('fidelity_seconds')} + {res.get('retrieval_seconds')} s)",
                  flush=True)
        if args.engine is not None:
            return 0

    section = dict(provenance(), model=args.model, prompt_set_sha256=digest, seed=args.seed,
                   lengths=args.lengths, samples_per_task_length=args.samples,
                   fidelity=dict(docs=len(docs), tokens_per_doc=context - 1,
                                 text=[os.path.basename(x) for x in args.fidelity_text]),
                   haystack=[os.path.basename(x) for x in args.haystack],
                   max_model_len=args.max_model_len, gpus=len(set(args.gpus or ["0"])),
                   workers=len(args.gpus or ["0"]), engines=[], retrieval=[],
                   fidelity_rows=[])
    results = [json.load(open(raw_path(i))) if os.path.exists(raw_path(i))
               else dict(error="no result: its worker stopped first") for i in range(len(engines))]
    ref = results[0] if "error" not in results[0] else None
    ref_correct = retrieval_rows(REFERENCE, ref, samples, None)[1] if ref and samples else None
    for (label, meta, _), res in zip(engines, results):
        if "error" in res:
            section["engines"].append(dict(label=label, **meta, error=res["error"]))
            continue
        section["engines"].append(dict(label=label, **meta, kv_cache_tokens=res["kv_cache_tokens"],
                                       fidelity_seconds=res["fidelity_seconds"],
                                       retrieval_seconds=res["retrieval_seconds"]))
        is_ref = label == REFERENCE
        section["fidelity_rows"] += fidelity_rows(label, res, None if is_ref else ref)
        if samples:
            section["retrieval"] += retrieval_rows(label, res, samples, None if is_ref else ref_correct)[0]
        print(f"{label}: " + ", ".join(f"{r['task']}@{r['length']} {r['accuracy']:.1f}%"
                                       for r in section["retrieval"] if r["engine"] == label)
              + "; " + ", ".join(f"{r['bucket']} ppl {r['ppl']:.3f}"
                                 + (f" top-1 {r['top1_agreement']:.4f}" if "top1_agreement" in r else "")
                                 for r in section["fidelity_rows"] if r["engine"] == label), flush=True)
    save(args.out, args.model_name, section)
    plot(json.load(open(args.out))["models"], png)
    return 0


def save(path: str, name: str, section: dict) -> None:
    """``section`` as model ``name``'s in ``path``, its fidelity rows under ``fidelity``."""
    section = dict(section, fidelity=dict(section["fidelity"], rows=section["fidelity_rows"]))
    section.pop("fidelity_rows")
    save_section(path, name, section)


if __name__ == "__main__":
    sys.exit(main())
