"""The calibration tool end to end on a tiny random Llama (offline, CPU)."""

import json

import torch
from safetensors import safe_open

from helpers import hf_config, write_model_config
from vllm_pq_backend import codebooks
from vllm_pq_backend.calibrate import main


def tiny_model(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    write_model_config(str(path), head_dim=32, q_heads=4, kv_heads=2, layers=2, vocab=300)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the quick brown fox jumps over a lazy dog while vllm serves tokens".split()
    tok.train_from_iterator(
        [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(str(path))).save_pretrained(path)
    return str(path)


def test_calibrate_writes_valid_codebooks(tmp_path, capsys):
    model = tiny_model(tmp_path / "model")
    text = tmp_path / "docs"
    text.mkdir()
    (text / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 80)
    (text / "b.jsonl").write_text(json.dumps({"text": "vllm serves tokens " * 120}) + "\n")
    assert main(["--model", model, "--text", str(text), "--m", "8", "--tokens", "1500",
                 "--samples", "600", "--seq-len", "256", "--niter", "3",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    out = tmp_path / "model" / "pq" / "codebooks_m8.safetensors"
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(model), 8, model)
    assert (info.m, info.head_dim, info.num_layers, info.num_kv_heads) == (8, 32, 2, 2)
    with safe_open(str(out), "pt") as f:
        k = f.get_tensor("k_centroids")
        meta = json.loads(f.metadata()["calibration"])
    assert k.shape == (2, 2, 8, 256, 4) and torch.isfinite(k).all()
    assert k[0, 0, 0].std() > 0  # trained, not left at zero
    assert meta["documents"] == 2 and 500 < meta["tokens"] <= 1500 and len(meta["rel_mse_k"]) == 2
    assert "wrote" in capsys.readouterr().out
