"""A model folder of Llama-3-8B's attention shape (32 layers, 32 query / 8 KV heads,
head_dim 128; bench_e2e.LLAMA3_8B), for timing where the weights do not matter; the
tokenizer is copied from another local model folder.

    python eval/random_model.py OUT_DIR --tokenizer-from eval/data/smollm2
    python eval/random_model.py OUT_DIR --tokenizer-from eval/data/smollm2 --dummy --bits 4 2 [--maps]

With --dummy only config.json and the tokenizer are written (serve it with
``--load-format dummy``), plus random PQ codebooks at the given bits per element under
OUT_DIR/pq/ (bench_e2e.write_model_dir); without it, random bf16 weights are saved
(16 GB), e.g. to time calibration.
"""

import argparse
import os
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench_e2e import LLAMA3_8B, write_model_dir  # eval/: the script's folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer-from", required=True)
    p.add_argument("--dummy", action="store_true", help="config and codebooks only, no weights")
    p.add_argument("--bits", type=int, nargs="+", default=[4], choices=(2, 4),
                   help="bits per element of the random codebooks (--dummy)")
    p.add_argument("--maps", action="store_true",
                   help="codebooks with K and V maps, as calibrate writes them (--dummy)")
    a = p.parse_args()
    cfg = LlamaConfig(**LLAMA3_8B)
    if a.dummy:
        write_model_dir(a.out, [cfg.head_dim * bits // 8 for bits in a.bits], a.maps)  # 8-bit codes
    else:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(cfg)
        model.save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer_from, f), a.out)
    print("saved", a.out)


if __name__ == "__main__":
    main()
