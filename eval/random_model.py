"""A model folder of Llama-3-8B's attention shape (32 layers, 32 query / 8 KV heads,
head_dim 128), for timing where the weights do not matter; the tokenizer is copied from
another local model folder.

    python eval/random_model.py OUT_DIR --tokenizer-from eval/data/smollm2
    python eval/random_model.py OUT_DIR --tokenizer-from eval/data/smollm2 --dummy --bits 4 2

With --dummy only config.json and the tokenizer are written (serve it with
``--load-format dummy``), plus random PQ codebooks at the given bits per element under
OUT_DIR/pq/ (decode speed does not depend on what the centroids are); without it, random
bf16 weights are saved (16 GB), e.g. to time calibration.
"""

import argparse
import os
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                 architectures=["LlamaForCausalLM"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer-from", required=True)
    p.add_argument("--dummy", action="store_true", help="config and codebooks only, no weights")
    p.add_argument("--bits", type=int, nargs="+", default=[4], choices=(2, 4),
                   help="bits per element of the random codebooks (--dummy)")
    a = p.parse_args()
    cfg = LlamaConfig(**LLAMA3_8B)
    if a.dummy:
        from vllm_pq_backend.codebooks import save_codebooks
        from vllm_pq_backend.config import default_codebook_path

        cfg.save_pretrained(a.out)
        g = torch.Generator().manual_seed(0)
        for bits in a.bits:
            m = cfg.head_dim * bits // 8  # subspaces of 8-bit codes
            shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, m, 256, cfg.head_dim // m)
            k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            save_codebooks(default_codebook_path(a.out, m), k, v, cfg, {"model": "random (benchmark)"})
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
