"""A model folder of Llama-3-8B's attention shape with random bf16 weights (32 layers,
32 query / 8 KV heads, head_dim 128), for timing calibration and kernels where the
weights do not matter; the tokenizer is copied from another local model folder.

    python eval/random_model.py OUT_DIR --tokenizer-from eval/data/smollm2
"""

import argparse
import os
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokenizer-from", required=True)
    a = p.parse_args()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer_from, f), a.out)
    print("saved", a.out)


if __name__ == "__main__":
    main()
