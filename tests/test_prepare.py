"""eval/prepare.py turns a GGUF into a bf16 Hugging Face folder that computes what llama.cpp
computes from the same file. A tiny Gemma 3 GGUF, written the way llama.cpp's converter
writes one (SentencePiece BPE vocabulary without merges, scores falling with the merge
order, runs of spaces as user-defined tokens, norm weights stored as 1 + w), goes through
prepare_model; its tokenizer, config and forward are checked against what llama.cpp does
with that file. The tokenizer repairs are also checked alone, without the gguf package."""

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import prepare  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
SPACES = [" " * n for n in range(2, 6)]  # user-defined, stored as spaces (as in Gemma's file)
BYTES = [f"<0x{b:02X}>" for b in range(256)]
FIRST_PIECE = len(SPECIALS) + len(SPACES) + len(BYTES)


def spm_bpe_vocab(text: str) -> list[str]:
    """A SentencePiece BPE vocabulary learnt from ``text`` until every word is one piece,
    laid out as Gemma's: specials, space runs, byte fallbacks, merged pieces in merge order,
    then the single characters."""
    words = Counter(w for w in text.replace(" ", " \u2581").split(" ") if w)
    seqs = {w: list(w) for w in words}
    merged = []
    while True:
        pairs = Counter()
        for w, s in seqs.items():
            for pair in zip(s, s[1:]):
                pairs[pair] += words[w]
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merged.append(best[0] + best[1])
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if s[i:i + 2] == list(best):
                    out.append(merged[-1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    chars = sorted({c for w in words for c in w})
    return SPECIALS + SPACES + BYTES + merged + chars


# Text the vocabulary is learnt from besides the probe, so that its pieces are shared by
# many words, as in a real vocabulary, and the probe's words are merged last.
CORPUS = ("It is a truth that the other side of the river is where the city keeps its old "
          "books, and that the people there read them in the morning and at night. The streets "
          "are narrow and the houses are tall; in the middle of it all there is a market where "
          "they sell bread, fruit and fish to anyone who knows how to ask for it.")
VOCAB = spm_bpe_vocab(prepare.PROBE + " " + CORPUS)
SCORES = ([-1000.0] * (len(SPECIALS) + len(SPACES)) + [0.0] * len(BYTES)
          + [-float(i) for i in range(len(VOCAB) - FIRST_PIECE)])
TYPES = [3] * len(SPECIALS) + [4] * len(SPACES) + [6] * len(BYTES) + [1] * (len(VOCAB) - FIRST_PIECE)
META = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": VOCAB,
        "tokenizer.ggml.token_type": TYPES}
# One token per whitespace-separated word (a word carries the space before it), BOS first.
PROBE_IDS = [2] + [VOCAB.index(w) for w in prepare.PROBE.replace(" ", " \u2581").split(" ")]
# Six spaces: SentencePiece and llama.cpp take the longest user-defined run (five), and the
# sixth space starts the next word's piece.
SPACED = "The" + " " * 6 + "capital"
SPACED_IDS = [2, VOCAB.index("The"), VOCAB.index(" " * 5), VOCAB.index("\u2581capital")]


def _sentencepiece_bpe():
    """The vocabulary as transformers' GGUF reader turns it into a BPE tokenizer: space runs
    spelled with "\u2581", merges in the order of the merged tokens."""
    from tokenizers.models import BPE

    spelled = ["\u2581" * len(t) if t in SPACES else t for t in VOCAB]
    index = {t: i for i, t in enumerate(spelled)}
    merges = sorted(((a, b) for m in spelled[len(SPECIALS):] if not m.startswith("<0x")
                     for k in range(1, len(m)) if (a := m[:k]) in index and (b := m[k:]) in index),
                    key=lambda p: index[p[0] + p[1]])
    return _fast_tokenizer(BPE(index, merges, unk_token="<unk>", byte_fallback=True))


def _fast_tokenizer(model):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(model)
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>", pad_token="<pad>")
    tok.add_bos_token = True
    return tok


def test_check_tokenizer_refuses_a_character_tokenizer_and_a_dropped_bos():
    """A tokenizer that spends a token on each character (what transformers before 5.18 saved
    for Gemma 3's GGUF) or that drops the BOS the GGUF asks for stops prepare_model; the BPE
    reading of the same vocabulary passes."""
    from tokenizers.models import BPE

    chars = _fast_tokenizer(BPE({t: i for i, t in enumerate(VOCAB)}, [], unk_token="<unk>",
                                byte_fallback=True))
    assert len(chars(prepare.PROBE)["input_ids"]) == len(prepare.PROBE) + 1
    with pytest.raises(SystemExit, match="use transformers>=5.18"):
        prepare.check_tokenizer(chars, True, 2)

    bpe = _sentencepiece_bpe()
    assert bpe(prepare.PROBE)["input_ids"] == PROBE_IDS
    prepare.check_tokenizer(bpe, True, 2)
    with pytest.raises(SystemExit, match="add_bos_token=False"):
        prepare.check_tokenizer(bpe, False, 2)


def test_space_runs_match_whole_as_in_llama_cpp():
    """Runs of spaces the file marks user-defined match whole, longest first, before BPE (as
    SentencePiece and llama.cpp do); BPE alone pairs them up differently."""
    tok = _sentencepiece_bpe()
    assert tok(SPACED)["input_ids"] != SPACED_IDS
    prepare.match_llama_cpp_tokenizer(tok, META)
    assert tok(SPACED)["input_ids"] == SPACED_IDS
    assert tok(prepare.PROBE)["input_ids"] == PROBE_IDS
    assert tok.decode(tok(SPACED)["input_ids"], skip_special_tokens=True) == SPACED


def test_smollm_pre_tokenizer_cuts_digits_first():
    """llama.cpp's "smollm" pre-tokenizer cuts digits one by one before the GPT-2 split: two
    spaces before a number stay one token, where the GPT-2 split alone leaves one space
    with the number (three tokens)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet + ["\u0120\u0120"])}
    t = Tokenizer(BPE(vocab, [("\u0120", "\u0120")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    pieces = ["a", "\u0120\u0120", "2", "0"]
    assert tok.convert_ids_to_tokens(tok("a  20")["input_ids"]) != pieces
    prepare.match_llama_cpp_tokenizer(tok, {"tokenizer.ggml.model": "gpt2",
                                            "tokenizer.ggml.pre": "smollm"})
    assert tok.convert_ids_to_tokens(tok("a  20")["input_ids"]) == pieces
    assert tok.decode(tok("a  20")["input_ids"]) == "a  20"


def test_gemma3_attention_scale_as_llama_cpp_and_unread_settings_refused():
    """llama.cpp scales Gemma 3's scores by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the
    62-layer 27B (head_dim 128, scalar 168); a file with settings the conversion does not
    carry over is refused in one line that names them."""
    from types import SimpleNamespace

    meta = {"gemma3.attention.sliding_window": 512}
    small = SimpleNamespace(hidden_size=640, num_attention_heads=4, num_hidden_layers=18,
                            head_dim=64, query_pre_attn_scalar=256)
    prepare.match_llama_cpp_gemma3(small, meta)
    assert small.query_pre_attn_scalar == 64
    big = SimpleNamespace(hidden_size=5376, num_attention_heads=32, num_hidden_layers=62,
                          head_dim=128, query_pre_attn_scalar=256)
    prepare.match_llama_cpp_gemma3(big, meta)
    assert big.query_pre_attn_scalar == 168
    with pytest.raises(SystemExit, match="gemma3.rope.scaling.type, which this conversion"):
        prepare.match_llama_cpp_gemma3(small, dict(meta, **{"gemma3.rope.scaling.type": "linear"}))
    with pytest.raises(SystemExit, match="no sliding window"):
        prepare.match_llama_cpp_gemma3(small, {})


# The tiny Gemma 3: 6 layers (5 sliding, 1 full, as llama.cpp assumes for gemma3), a
# 4-token window over 12 tokens, 2 query heads sharing 1 KV head of 16.
H, HEADS, KV, HD, FF, LAYERS, WINDOW, CTX, THETA = 32, 2, 1, 16, 48, 6, 4, 64, 50_000.0
NAMES = {"attn_q": (HEADS * HD, H), "attn_k": (KV * HD, H), "attn_v": (KV * HD, H),
         "attn_output": (H, HEADS * HD), "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF),
         "attn_norm": (H,), "ffn_norm": (H,), "post_attention_norm": (H,), "post_ffw_norm": (H,),
         "attn_q_norm": (HD,), "attn_k_norm": (HD,)}


def _tensors(seed=0):
    """Random weights exact in bf16; norms as llama.cpp stores them (1 + w), with w and 1 + w
    both exact in bf16, so the bf16 folder holds the very numbers the GGUF does."""
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).bfloat16().float()

    def norm(n):
        return 1 + torch.randint(-24, 25, (n,), generator=g) / 32

    t = {"token_embd.weight": mat(len(VOCAB), H), "output_norm.weight": norm(H)}
    for i in range(LAYERS):
        for name, shape in NAMES.items():
            t[f"blk.{i}.{name}.weight"] = norm(shape[0]) if name.endswith("norm") else mat(*shape)
    return t


def _write_gguf(path, tensors):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(CTX)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(THETA)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, x in tensors.items():
        w.add_tensor(name, x.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_gemma3(t, ids):
    """Gemma 3's forward as llama.cpp runs it from the GGUF's tensors (float64): embeddings
    times sqrt(hidden); norms multiply by the stored weight; q/k RMS-normed per head; NeoX
    RoPE, base 10,000 on sliding layers and the file's base on every 6th; scores scaled by
    1/sqrt(head_dim); a sliding layer sees the last WINDOW positions; GELU (tanh) gating;
    output through the tied embedding."""
    t = {k: v.double() for k, v in t.items()}
    n = len(ids)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x, theta):
        inv = theta ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1) * sin

    pos = torch.arange(n)
    x = t["token_embd.weight"][ids] * math.sqrt(H)
    for i in range(LAYERS):
        w = {k: t[f"blk.{i}.{k}.weight"] for k in NAMES}
        sliding = (i + 1) % 6 != 0
        h = rms(x, w["attn_norm"])
        q = rms((h @ w["attn_q"].T).view(n, HEADS, HD), w["attn_q_norm"])
        k = rms((h @ w["attn_k"].T).view(n, KV, HD), w["attn_k_norm"])
        v = (h @ w["attn_v"].T).view(n, KV, HD)
        q, k = rope(q, 10_000.0 if sliding else THETA), rope(k, 10_000.0 if sliding else THETA)
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
        seen = (pos[None] <= pos[:, None]) & ((pos[:, None] - pos[None] < WINDOW) | (not sliding))
        p = torch.softmax(s.masked_fill(~seen, -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(n, HEADS * HD) @ w["attn_output"].T
        x = x + rms(o, w["post_attention_norm"])
        h = rms(x, w["ffn_norm"])
        f = (torch.nn.functional.gelu(h @ w["ffn_gate"].T, approximate="tanh") * (h @ w["ffn_up"].T))
        x = x + rms(f @ w["ffn_down"].T, w["post_ffw_norm"])
    return rms(x, t["output_norm.weight"]) @ t["token_embd.weight"].T


def test_a_gemma3_gguf_becomes_the_model_llama_cpp_runs(tmp_path):
    """prepare_model on a Gemma 3 GGUF: the folder's tokenizer splits text as llama.cpp does
    with the file (one token per word here, BOS first, space runs whole), its config carries
    the file's context, window, layer pattern, RoPE bases and llama.cpp's score scale
    1/sqrt(head_dim), its norm weights are the stored ones less 1, and its forward equals
    llama.cpp's computation from the file's tensors."""
    for package, pin in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0")):
        pytest.importorskip(package, reason=f"transformers loads a GGUF only with {package} "
                                            f"(pip install {pin})")
    import transformers
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 18):
        pytest.skip("prepare.py needs transformers>=5.18: before it, Gemma 3's GGUF tokenizer "
                    "is built one token per character (prepare.py refuses it)")
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tensors = _tensors()
    gguf_path = tmp_path / "tiny-gemma3.gguf"
    _write_gguf(gguf_path, tensors)
    out = tmp_path / "bf16"
    prepare.prepare_model(str(out), str(gguf_path))

    tok = AutoTokenizer.from_pretrained(out)
    assert tok(prepare.PROBE)["input_ids"] == PROBE_IDS
    assert tok(SPACED)["input_ids"] == SPACED_IDS
    assert len(tok) == len(VOCAB)

    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.max_position_embeddings, cfg.sliding_window, cfg.head_dim) == (CTX, WINDOW, HD)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"])
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == THETA
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.query_pre_attn_scalar == HD and cfg.final_logit_softcapping is None

    sd = load_file(out / "model.safetensors")
    assert torch.equal(sd["model.layers.5.input_layernorm.weight"].float(),
                       tensors["blk.5.attn_norm.weight"] - 1)
    assert torch.equal(sd["model.layers.0.self_attn.q_norm.weight"].float(),
                       tensors["blk.0.attn_q_norm.weight"] - 1)
    assert torch.equal(sd["model.norm.weight"].float(), tensors["output_norm.weight"] - 1)

    ids = torch.tensor(PROBE_IDS[:12])  # 12 positions: three times the window
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(ids[None]).logits[0].double()
    want = _llama_cpp_gemma3(tensors, ids)
    err = ((got - want).abs().amax(-1) / want.abs().amax(-1))
    assert err.max() < 1e-4, err
