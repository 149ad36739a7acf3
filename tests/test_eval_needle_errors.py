"""eval/needle_errors.py on a tiny random Llama (CPU): the needle's digits and the
haystack are the positions it says, and each file's K and V are read through its own
codebooks."""

import json
import random
import sys
from pathlib import Path

import pytest

from helpers import write_model_config
from vllm_pq_backend.calibrate import main as calibrate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import needle_errors  # noqa: E402
from long_context import Text, make_sample  # noqa: E402

WORDS = "the pass key is remember it a lazy dog jumps over quick brown fox".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from helpers import hf_config

    root = tmp_path_factory.mktemp("needle")
    model = root / "model"
    write_model_config(str(model), head_dim=32, q_heads=4, kv_heads=2, layers=2, vocab=300)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.sample(WORDS, len(WORDS))) + " The . What ?" for _ in range(50)]
                            + [str(rng.randint(0, 9)) for _ in range(200)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(model)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(str(model))).save_pretrained(model)
    hay = root / "hay.jsonl"
    hay.write_text("".join(json.dumps({"text": "\n\n".join(
        " ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(6))}) + "\n" for _ in range(20)))
    files = []
    for name, bits in (("b4", []), ("k4v2", ["--bits-v", "2"])):
        out = root / f"{name}.safetensors"
        assert calibrate(["--model", str(model), "--text", str(hay), "--tokens", "1500",
                          "--samples", "600", "--seq-len", "256", "--niter", "3", "--device", "cpu",
                          "--dtype", "float32", "--out", str(out), *bits]) == 0
        files.append(str(out))
    result = root / "needle.json"
    assert needle_errors.main(["--model", str(model), "--length", "1024", "--prompts", "3",
                               "--haystack", str(hay), "--device", "cpu", "--codebooks", *files,
                               "--out", str(result)]) == 0
    return model, hay, files, json.loads(result.read_text())


def test_digits_and_haystack_are_the_prompts_positions(setup):
    from transformers import AutoTokenizer

    model, hay, _, data = setup
    tok = AutoTokenizer.from_pretrained(model)
    text, rng = Text(tok, [str(hay)]), random.Random(0)
    digits = haystack = 0
    for s in range(3):
        smp = make_sample(text, "passkey", 1024, (s + 0.5) / 3, rng)
        ids, key = smp["ids"], smp["answer"]
        needle = text.encode_many([f"The pass key is {key}. Remember it. {key} is the pass key."])[0]
        at = [i for i in range(len(ids)) if ids[i : i + len(needle)] == needle]
        assert len(at) == 1
        digits += sum(tok.decode([t]).strip().isdigit() for t in needle)
        # BOS, the needle and the last TAIL positions are not the haystack's
        kept = set(range(1, len(ids) - needle_errors.TAIL)) - set(range(at[0], at[0] + len(needle)))
        haystack += len(kept)
    assert digits > 0
    assert (data["digit_tokens"], data["haystack_tokens"]) == (digits, haystack)


def test_each_file_is_read_through_its_own_codebooks(setup):
    _, _, files, data = setup
    b4, k4v2 = (m["codebook_sha256"] for m in data["codebooks"])
    rows = {(r["codebook_sha256"], r["part"], r["layer"]): r for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == 2 * 2 * 2
    for layer in range(2):
        # K is trained alike at 4 bits in both files: the same error; V at 2 bits errs more
        assert rows[b4, "k", layer]["haystack"] == rows[k4v2, "k", layer]["haystack"]
        for where in ("digits", "haystack"):
            assert 0 < rows[b4, "v", layer][where] < rows[k4v2, "v", layer][where] < 1
