"""eval/layer_kl.py on a tiny random Llama (CPU): each layer's K or V alone, read through
its codes outside the window, costs the KL that eager attention gives by hand."""

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import hf_config, write_model_config
from vllm_pq_backend.calibrate import main as calibrate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import layer_kl  # noqa: E402
from accuracy_sim import dequant  # noqa: E402
from long_context import Text, fidelity_docs  # noqa: E402

from test_calibrate import save_tokenizer, WORDS  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("layer_kl")
    model = root / "model"
    write_model_config(str(model), head_dim=32, q_heads=4, kv_heads=2, layers=2, vocab=300)
    save_tokenizer(model)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(hf_config(str(model)))
    with torch.no_grad():  # sharper attention than random weights give: codes matter
        for name, w in llama.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "lm_head.weight")):
                w.mul_(8)
    llama.save_pretrained(model)
    text = root / "text.jsonl"
    g = torch.Generator().manual_seed(0)
    text.write_text("".join(json.dumps({"text": "\n\n".join(
        " ".join(WORDS[j] for j in torch.randint(len(WORDS), (12,), generator=g).tolist())
        for _ in range(6))}) + "\n" for _ in range(30)))
    books = root / "b2.safetensors"
    assert calibrate(["--model", str(model), "--text", str(text), "--tokens", "1500", "--bits", "2",
                      "--samples", "600", "--seq-len", "256", "--niter", "3", "--device", "cpu",
                      "--dtype", "float32", "--out", str(books)]) == 0
    out = root / "kl.json"
    assert layer_kl.main(["--model", str(model), "--codebooks", str(books), "--text", str(text),
                          "--docs", "2", "--length", "200", "--window", "32", "--device", "cpu",
                          "--out", str(out)]) == 0
    return str(model), str(text), str(books), json.loads(out.read_text())


def _by_hand(model, docs, books, layer, part, window):
    """Eager attention, every layer exact but ``layer``'s ``part``, which reads the rows
    before window_start(i) (BOS aside) as their codes decode: summed KL to exact."""
    from transformers import AttentionInterface

    from vllm_pq_backend.layout import window_start

    def attn(module, q, k, v, mask, scaling=None, **kw):
        g = q.shape[1] // k.shape[1]
        t = k.shape[2]
        rep = lambda x: x[0].repeat_interleave(g, 0)  # noqa: E731
        pos = torch.arange(t)
        causal = pos.view(1, -1) <= pos.view(-1, 1)
        coded = (pos.view(1, -1) < window_start(pos, window).view(-1, 1)) & (pos.view(1, -1) > 0)
        if layer is None or module.layer_idx != layer:
            coded[:] = False
        x = (k if part == "k" else v)[0].transpose(0, 1)
        b = books[module.layer_idx]
        xh = dequant(x, b[part], b[f"{part}_transform"]).transpose(0, 1)[None]
        kc, vc = (xh, v) if part == "k" else (k, xh)
        s = torch.where(coded, q[0] @ rep(kc).transpose(1, 2), q[0] @ rep(k).transpose(1, 2))
        p = (s * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
        out = (p * ~coded) @ rep(v) + (p * coded) @ rep(vc)
        return out.transpose(0, 1)[None], None

    AttentionInterface.register("kl_by_hand", attn)
    model.config._attn_implementation = "kl_by_hand"
    with torch.no_grad():
        return [model(torch.tensor([d])).logits[0].float().log_softmax(-1) for d in docs]


def test_each_part_costs_the_kl_eager_attention_gives(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, text, books_path, data = setup
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    docs = fidelity_docs(Text(AutoTokenizer.from_pretrained(path), [text]), 2, 200, 0)
    assert data["positions"] == sum(map(len, docs)) == 400
    books = layer_kl.read_layers(books_path, "cpu")
    exact = _by_hand(model, docs, books, None, "k", 32)
    rows = {(r["layer"], r["part"]): r["kl"] for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == 2 * 2 + 1
    wants = []
    for layer in range(2):
        for part in "kv":
            got = _by_hand(model, docs, books, layer, part, 32)
            want = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(exact, got)) / 400
            # 1e-8: the float32 floor of a KL summed over a 300-word vocabulary
            assert abs(rows[layer, part] - want) <= 1e-3 * want + 1e-8, (layer, part, want)
            wants.append(want)
    # layer 0's values are a function of the token alone, of a few dozen in the text: their
    # codes are nearly exact; the other parts cost clearly more than the float32 floor
    assert sum(w > 1e-5 for w in wants) == 3
    # every part at once costs more than any one alone
    assert rows[None, "kv"] > max(v for (layer, _), v in rows.items() if layer is not None)


def test_refuses_a_sliding_window_model(setup, tmp_path):
    path, text, books_path, _ = setup
    cfg = json.loads(Path(path, "config.json").read_text())
    other = tmp_path / "sw"
    other.mkdir()
    for f in Path(path).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    with pytest.raises(SystemExit):
        layer_kl.main(["--model", str(other), "--codebooks", books_path, "--text", text,
                       "--device", "cpu", "--out", str(tmp_path / "x.json")])
