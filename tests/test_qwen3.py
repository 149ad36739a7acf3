"""A QK-norm model (Qwen3) through calibration, on a tiny random Qwen3 with Qwen3-8B's
attention shape (32 query heads, 8 KV heads, head_dim 128) and 2 layers (offline, CPU).

Qwen3 normalizes each head's q and k (q_norm, k_norm: RMSNorm over head_dim) before RoPE,
inside the model: the keys the backend stores, and so the keys calibration must train on,
are k_norm's output rotated by RoPE. The tiny model's QK-norm weights are set far from
their initial ones (as trained weights are), so that keys with and without the norm differ
in scale and shape per dimension and a capture of the wrong ones is caught."""

import json

import pytest
import torch
from safetensors import safe_open

from helpers import hf_config, vllm_config
from test_calibrate import WORDS, save_tokenizer
from vllm_pq_backend import codebooks
from vllm_pq_backend.calibrate import capture, load_model, main
from vllm_pq_backend.reference import decode_codes, encode

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 2


def tiny_qwen3(path):
    """A random Qwen3 folder (config, weights, tokenizer) with Qwen3-8B's attention shape
    and rope_theta; hidden size 256 (Qwen3 sets head_dim apart from hidden_size)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=300, hidden_size=256, intermediate_size=256,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # per-dimension scales from 0.14 to 7 (initialized to 1)
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(torch.randn(HEAD_DIM).exp())
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def text(seed: int, words: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=g).tolist())


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "model")


def attention_keys(model, ids):
    """Per layer, the keys ``[T, KV heads, head_dim]`` of ``ids`` as Qwen3's attention
    makes them (k_proj, k_norm, RoPE), and as they would be without k_norm (k_proj, RoPE),
    computed from each attention module's inputs."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    got = {}

    def hook(module, args, kwargs):
        h = kwargs["hidden_states"][0]
        cos, sin = kwargs["position_embeddings"]
        k = module.k_proj(h).view(h.shape[0], KV_HEADS, HEAD_DIM)

        def rope(x):  # [T, H, d] as the model rotates [1, H, T, d]
            x = x.transpose(0, 1)[None]
            return apply_rotary_pos_emb(x, x, cos, sin)[1][0].transpose(0, 1)

        got[module.layer_idx] = (rope(module.k_norm(k)), rope(k))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return [got[i] for i in range(LAYERS)]


def relative(err, ref):
    return float(err.square().sum() / ref.square().sum())


def test_capture_records_post_qk_norm_post_rope_keys(qwen3):
    """Calibration's capture (a transformers attention function) receives the keys after
    k_norm and RoPE: every captured K row is, to fp16 rounding, the key the model's
    attention computes at one position (each position once), and far from that key
    without k_norm. Would the capture hook in before the norm, this fails."""
    cfg, tok, model = load_model(qwen3, "float32", "cpu")
    assert cfg.model_type == "qwen3"
    ids = [tok.bos_token_id] + tok(text(1, 150), add_special_tokens=False)["input_ids"]
    keys = attention_keys(model, ids)
    stats = capture(model, tok, [ids], keep_fraction=1.0, seed=0, window=0, device="cpu",
                    progress=False)
    t = len(ids)
    for layer, ((normed, plain), st) in enumerate(zip(keys, stats)):
        got = st.rows("k")  # [T, KV heads, head_dim], positions in a random order
        assert got.shape == (t, KV_HEADS, HEAD_DIM)
        at = torch.cdist(got.view(t, -1), normed.reshape(t, -1)).argmin(1)  # each row's position
        assert torch.equal(at.sort().values, torch.arange(t)), layer  # every position once
        want = normed[at]
        assert relative(got - want, want) < 1e-6, layer  # fp16 rounding
        assert ((got - want).abs() <= 1e-3 * want.abs() + 1e-3).all(), layer
        assert relative(got - plain[at], plain[at]) > 0.5, layer  # the norm matters here
        assert torch.allclose(st.sink[0], normed[0].float(), rtol=1e-5, atol=1e-5)  # BOS


@pytest.mark.parametrize("bits,m", [(4, 64), (2, 32)])
def test_calibrate_qwen3(qwen3, tmp_path, bits, m):
    """``python -m vllm_pq_backend.calibrate`` on the tiny Qwen3 at 4 and 2 bits per
    element: a file of layers x 8 KV heads x M x 256 x head_dim/M centroids whose K
    codebooks fit the model's post-QK-norm, post-RoPE keys of held-out text, and not those
    keys without k_norm; the backend starts every layer of the model, as vLLM reads it,
    with the file."""
    (tmp_path / "a.txt").write_text(text(0, 1500))
    out = tmp_path / f"books_{bits}.safetensors"
    assert main(["--model", qwen3, "--text", str(tmp_path / "a.txt"), "--bits", str(bits),
                 "--tokens", "1000", "--samples", "600", "--seq-len", "256", "--niter", "3",
                 "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(qwen3), m, m, qwen3)
    assert (info.m_k, info.m_v, info.head_dim, info.num_layers, info.num_kv_heads) == (
        m, m, HEAD_DIM, LAYERS, KV_HEADS)
    shape = [LAYERS, KV_HEADS, m, 256, HEAD_DIM // m]
    with safe_open(str(out), "pt") as f:
        assert f.get_slice("k_centroids").get_shape() == shape
        assert f.get_slice("v_centroids").get_shape() == shape
        assert f.get_slice("k_transform").get_shape() == [LAYERS, KV_HEADS, HEAD_DIM, HEAD_DIM]
        meta = json.loads(f.metadata()["calibration"])
    assert meta["tokens"] == 1000 and len(meta["rel_mse_k"]) == LAYERS

    _, tok, model = load_model(qwen3, "float32", "cpu")
    ids = [tok.bos_token_id] + tok(text(99, 300), add_special_tokens=False)["input_ids"]
    for layer, (normed, plain) in enumerate(attention_keys(model, ids)):
        k_cb, _ = codebooks.load_layer(info, layer, slice(None))
        tk, _ = codebooks.load_transforms(info, layer, slice(None))
        errs = []
        for keys in (normed[1:], plain[1:]):  # BOS left out: its codes are pinned exact
            mapped = torch.einsum("nhd,hde->nhe", keys, tk)
            rec = torch.einsum("nhe,hed->nhd", decode_codes(encode(mapped, k_cb), k_cb),
                               torch.linalg.inv(tk))
            errs.append(relative(rec - keys, keys))
        fit, without_norm = errs
        assert fit < (0.02 if bits == 4 else 0.1), (layer, errs)
        assert without_norm > 8 * fit, (layer, errs)

    import types

    from vllm.config import set_current_vllm_config

    from vllm_pq_backend.impl import PQAttentionImpl

    vc = vllm_config(qwen3, block_size=128, pq={"codebooks": str(out), "window": 128})
    assert vc.model_config.architectures == ["Qwen3ForCausalLM"]
    assert vc.model_config.get_head_size() == HEAD_DIM
    with set_current_vllm_config(vc):
        impl = PQAttentionImpl(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS)
        for layer in range(LAYERS):
            st = impl.state(types.SimpleNamespace(layer_name=f"model.layers.{layer}.self_attn.attn"),
                            torch.zeros(1, dtype=torch.bfloat16))
            assert st.k_cb.shape == (KV_HEADS, m, 256, HEAD_DIM // m)
            assert st.maps["key"].shape == (KV_HEADS, HEAD_DIM, HEAD_DIM)
