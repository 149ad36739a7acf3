"""The calibration tool end to end on a tiny random Llama (offline, CPU)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import hf_config, write_model_config
from vllm_pq_backend import codebooks
from vllm_pq_backend.calibrate import main


WORDS = "the quick brown fox jumps over a lazy dog while vllm serves tokens".split()


def tiny_model(path, head_dim=32):
    from transformers import LlamaForCausalLM

    write_model_config(str(path), head_dim=head_dim, q_heads=4, kv_heads=2, layers=2, vocab=300)
    save_tokenizer(path)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(str(path))).save_pretrained(path)
    return str(path)


def save_tokenizer(path):
    """A 300-token BPE over WORDS, ids 0-2 for <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def tiny_gemma3():
    """A random Gemma 3 text model: one sliding-window layer (window 8), one full layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, sliding_window=8, query_pre_attn_scalar=64,
                           layer_types=["sliding_attention", "full_attention"],
                           attn_implementation="eager")
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


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
    codebooks.validate(info, hf_config(model), 8, 8, model)
    assert (info.m_k, info.m_v, info.head_dim, info.num_layers, info.num_kv_heads) == (8, 8, 32, 2, 2)
    with safe_open(str(out), "pt") as f:
        k = f.get_tensor("k_centroids")
        meta = json.loads(f.metadata()["calibration"])
        tk = f.get_tensor("k_transform")
    assert k.shape == (2, 2, 8, 256, 4) and torch.isfinite(k).all()
    assert codebooks.nan_code_free(k)  # the NaN marker's slot holds no centroid of its own
    assert k[0, 0, 0].std() > 0  # trained, not left at zero
    assert tk.shape == (2, 2, 32, 32) and torch.linalg.matrix_rank(tk[0, 0]) == 32
    assert meta["documents"] == 2 and 500 < meta["tokens"] <= 1500 and len(meta["rel_mse_k"]) == 2
    assert info.transforms == ("k_transform", "v_transform")
    got = capsys.readouterr()
    assert "wrote" in got.out
    # 256-token sequences of a model with 4096 positions: the user is told that longer
    # contexts lose accuracy, and what to run instead
    assert "the longest sequence is 256 tokens of the model's 4096" in got.err
    assert "--seq-len N and --tokens of at least N" in got.err


def test_calibrate_a_model_with_attention_sinks(tmp_path):
    """gpt-oss's shape: calibration runs the model with its sink logits in every softmax
    (test_capture_reproduces_the_models_attention) and writes a codebook per layer and KV
    head; the logits themselves are weights, not cached, so nothing of them is coded."""
    model = gpt_oss_model(tmp_path / "model")
    text = tmp_path / "a.txt"
    text.write_text(" ".join(WORDS) * 100)
    out = tmp_path / "b4.safetensors"
    assert main(["--model", model, "--text", str(text), "--tokens", "1024", "--seq-len", "256",
                 "--niter", "3", "--device", "cpu", "--out", str(out)]) == 0
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(model), 32, 32, model)
    with safe_open(str(out), "pt") as f:
        k, v = f.get_tensor("k_centroids"), f.get_tensor("v_centroids")
    assert k.shape == v.shape == (2, 8, 32, 256, 2)  # 4 bits per element at head_dim 64
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    # the window serving picks below its 128-token sliding window (config.default_window)
    assert int(codebooks.calibration_of(info)["window"]) == 64


def test_calibrate_defaults_to_packed_sequences_of_the_models_context(tmp_path):
    """Without --seq-len, sequences are the model's context long (at most --tokens) and
    packed across documents: the codebooks see keys at every position served."""
    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 240)
    (tmp_path / "b.txt").write_text("vllm serves tokens " * 360)
    out = tmp_path / "books.safetensors"
    common = ["--model", model, "--m", "8", "--tokens", "1500", "--samples", "600",
              "--niter", "1", "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    assert main([*common, "--text", str(tmp_path / "b.txt"), str(tmp_path / "a.txt")]) == 0
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["calibration"])
    assert meta["pack"] is True and meta["seq_len"] == 1500  # min(context 4096, --tokens)
    assert meta["tokens"] == 1500  # one full sequence across both documents
    assert main([*common, "--text", str(tmp_path / "a.txt"), "--seq-len", "256", "--no-pack"]) == 0
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["calibration"])
    assert meta["pack"] is False and meta["seq_len"] == 256


def test_calibrate_k4_v2(tmp_path, capsys):
    """K at 4 bits and V at 2: each with its own subspaces, in the file the backend picks."""
    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 80)
    assert main(["--model", model, "--text", str(tmp_path / "a.txt"), "--bits-k", "4",
                 "--bits-v", "2", "--tokens", "1000", "--samples", "600", "--seq-len", "256",
                 "--niter", "2", "--device", "cpu", "--dtype", "float32"]) == 0
    out = tmp_path / "model" / "pq" / "codebooks_m16_v8.safetensors"
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(model), 16, 8, model)
    assert (info.m_k, info.m_v) == (16, 8)
    with safe_open(str(out), "pt") as f:
        assert f.get_slice("k_centroids").get_shape() == [2, 2, 16, 256, 2]
        assert f.get_slice("v_centroids").get_shape() == [2, 2, 8, 256, 4]
        assert (f.metadata()["bits_k"], f.metadata()["bits_v"]) == ("4", "2")
    printed = capsys.readouterr()
    assert "K 4 / V 2 bits per element" in printed.out and '"m": 16, "m_v": 8' in printed.out
    assert "calibrate: warning: running on the CPU: under a minute for 0.33M parameters" in printed.err


def test_calibrate_v_bits_by_layer(tmp_path, capsys):
    """--bits-v-layers: V of layer 1 at 4 bits, layer 0 at --bits-v 2, each trained in the
    metric calibrate uses at its bits (o_proj at 2 bits), in a file the backend serves."""
    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 80)
    common = ["--model", model, "--text", str(tmp_path / "a.txt"), "--bits-v", "2",
              "--tokens", "1000", "--samples", "600", "--seq-len", "256", "--niter", "2",
              "--device", "cpu", "--dtype", "float32"]
    assert main([*common, "--bits-v-layers", "4@1"]) == 0
    out = tmp_path / "model" / "pq" / "codebooks_m16_v8_v16l1.safetensors"
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(model), None, None, model)
    assert (info.m_k, info.m_v_layers, info.bits_v) == (16, (8, 16), 3)
    k0, v0 = codebooks.load_layer(info, 0, slice(None))
    _, v1 = codebooks.load_layer(info, 1, slice(None))
    assert v0.shape == (2, 8, 256, 4) and v1.shape == (2, 16, 256, 2)
    assert codebooks.nan_code_free(v0) and codebooks.nan_code_free(v1)
    cal = codebooks.calibration_of(info)
    assert cal["bits_v_layers"] == {"4": "1"} and cal["method"]["v_gamma"] == 0.5
    assert cal["methods_v_layers"]["4"]["v_gamma"] == 0.0
    printed = capsys.readouterr().out
    assert "K 4 / V 2 bits per element, V 4 in layer 1 (3.5 bits" in printed
    assert f'"codebooks": "{out}"' in printed
    # every layer at other bits than --bits-v: one rate, an ordinary file
    assert main([*common, "--bits-v-layers", "4@0-1", "--out", str(tmp_path / "u.safetensors")]) == 0
    assert codebooks.read_info(str(tmp_path / "u.safetensors")).m_v == 16


def calibrated_by_cost(tmp_path, flag: str):
    """The tiny model calibrated with ``flag`` 2.5 (--bits-v-mean, --bits-mean) on CPU: the
    file's header, checked against the model, and its calibration metadata."""
    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 80)
    out = tmp_path / "auto.safetensors"
    assert main(["--model", model, "--text", str(tmp_path / "a.txt"), flag, "2.5",
                 "--tokens", "1000", "--samples", "600", "--seq-len", "256", "--niter", "2",
                 "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    info = codebooks.read_info(str(out))
    codebooks.validate(info, hf_config(model), None, None, model)
    return info, codebooks.calibration_of(info)


def test_calibrate_chooses_v_bits_by_cost(tmp_path, capsys):
    """--bits-v-mean 2.5: each layer's V is trained at 4, 2 and 1 bits, its cost to the loss
    measured through a backward pass, and the cheapest choice for the mean written, with
    the costs, as a file whose layers' bits are what the allocation picked."""
    from vllm_pq_backend.calibrate import allocate_bits

    info, cal = calibrated_by_cost(tmp_path, "--bits-v-mean")
    costs = [{float(b): c for b, c in layer.items()} for layer in cal["v_cost"]]
    assert cal["bits_v_mean"] == 2.5 and [sorted(c) for c in costs] == [[1.0, 2.0, 4.0]] * 2
    # layer 0's values are a function of the token alone, and the text has a few dozen
    # tokens: exact at every width; layer 1's cost falls with the bits
    assert all(c >= 0 for layer in costs for c in layer.values())
    assert 0 < costs[1][4.0] < costs[1][2.0] < costs[1][1.0]
    bits = [info.m_v_layers[i] * 8 / 32 for i in range(2)]
    assert bits == allocate_bits(costs, 2.5) and sum(bits) / 2 <= 2.5
    assert "bits chosen by cost: K 4 / V " in capsys.readouterr().out
    assert [sorted(map(float, layer)) for layer in cal["k_cost"]] == [[4.0]] * 2


def test_calibrate_chooses_k_and_v_bits_by_cost(tmp_path, capsys):
    """--bits-mean 2.5: K and V of each layer trained at every width the built pairs have
    (4, 2, 1 bits), each one's cost measured, and each layer's (K, V) pair the cheapest
    choice for the mean (the knapsack over the recorded costs, pairs K/V 1/1, 2/2, 4/1,
    4/2, 4/4); the file holds each layer's K and V at its pair's widths, and serves."""
    from vllm_pq_backend.calibrate import allocate_bits

    info, cal = calibrated_by_cost(tmp_path, "--bits-mean")
    assert cal["bits_mean"] == 2.5 and "bits_v_mean" not in cal
    costs = {part: [{float(b): c for b, c in layer.items()} for layer in cal[f"{part}_cost"]]
             for part in "kv"}
    assert all(sorted(layer) == [1.0, 2.0, 4.0] for part in "kv" for layer in costs[part])
    assert 0 < costs["k"][1][4.0] < costs["k"][1][2.0] < costs["k"][1][1.0]
    pairs = {1.0: (1, 1), 2.0: (2, 2), 2.5: (4, 1), 3.0: (4, 2), 4.0: (4, 4)}
    pair_costs = [{b: ck[bk] + cv[bv] for b, (bk, bv) in pairs.items()}
                  for ck, cv in zip(costs["k"], costs["v"])]
    want = [pairs[b] for b in allocate_bits(pair_costs, 2.5)]
    got = [(mk * 8 // 32, mv * 8 // 32) for mk, mv in info.pairs]
    assert got == want and (info.bits_k + info.bits_v) / 2 <= 2.5
    for layer, (mk, mv) in enumerate(info.pairs):
        k, v = codebooks.load_layer(info, layer, slice(None))
        assert k.shape == (2, mk, 256, 32 // mk) and v.shape == (2, mv, 256, 32 // mv)
    assert f"bits chosen by cost: {info.describe()}" in capsys.readouterr().out


def test_fit_k_measured_keeps_each_layers_cheapest_training(tmp_path, capsys):
    """--fit-k measured: every layer's K trained each way of K_FITS and priced (the KL of
    its codes, recorded per layer and training); each layer keeps the cheapest, and its K
    codebook and map are exactly what calibrating every layer that way writes (the same
    seed and samples)."""
    from safetensors import safe_open

    from vllm_pq_backend.calibrate import K_FITS

    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog jumps over the quick brown fox " * 80)

    def calibrate(name, *extra):
        out = tmp_path / f"{name}.safetensors"
        assert main(["--model", model, "--text", str(tmp_path / "a.txt"), "--m", "16",
                     "--tokens", "1000", "--samples", "600", "--seq-len", "256", "--niter",
                     "2", "--device", "cpu", "--dtype", "float32", "--out", str(out),
                     *extra]) == 0
        info = codebooks.read_info(str(out))
        codebooks.validate(info, hf_config(model), 16, 16, model)
        with safe_open(str(out), "pt") as f:
            return (f.get_tensor("k_centroids"), f.get_tensor("k_transform"),
                    codebooks.calibration_of(info))

    k, t, cal = calibrate("fit", "--fit-k", "measured")
    fit = cal["k_fit"]
    assert fit["candidates"] == K_FITS and len(fit["kl"]) == 2
    for layer, costs in enumerate(fit["kl"]):
        assert sorted(costs) == sorted(K_FITS) and all(c >= 0 for c in costs.values())
        assert costs[fit["chosen"][layer]] == min(costs.values()), costs  # ties: K_FITS' order
        over = K_FITS[fit["chosen"][layer]]
        fixed_k, fixed_t, _ = calibrate(fit["chosen"][layer], "--method",
                                        *(f"{f}={v}" for f, v in over.items()))
        assert torch.equal(k[layer], fixed_k[layer]) and torch.equal(t[layer], fixed_t[layer])
    assert "K's training by layer: " in capsys.readouterr().out


def test_allocate_bits_is_the_cheapest_choice_for_the_mean():
    """The knapsack against every choice, on random costs (layers x widths 1, 2, 4)."""
    import itertools

    from vllm_pq_backend.calibrate import allocate_bits

    g = torch.Generator().manual_seed(0)
    for mean in (1.0, 1.5, 2.0, 2.4, 3.0, 4.0):
        costs = [dict(zip((1.0, 2.0, 4.0), sorted(torch.rand(3, generator=g).tolist(), reverse=True)))
                 for _ in range(5)]
        best = min((sum(c[b] for c, b in zip(costs, pick)), pick)
                   for pick in itertools.product((1.0, 2.0, 4.0), repeat=5)
                   if sum(pick) <= mean * 5 + 1e-9)
        got = allocate_bits(costs, mean)
        assert sum(got) <= mean * 5 + 1e-9
        assert abs(sum(c[b] for c, b in zip(costs, got)) - best[0]) < 1e-12, (mean, got, best)


@pytest.mark.parametrize("args,needle", [
    (["--bits-v-layers", "4@2"], "--bits-v-layers 4@2: the model has 2 layers, 0 to 1"),
    (["--bits-v-layers", "3@0"], "'3@0': give BITS@LAYERS with BITS one of [1, 2, 4]"),
    (["--bits-v-layers", "4@1-0"], "'4@1-0': give BITS@LAYERS"),
    (["--bits-v-mean", "5"], "--bits-v-mean 5: with --bits 4 V can have 1, 2, 4 bits per "
                             "layer, so a mean from 1 to 4"),
    (["--bits-v-mean", "2", "--bits-v", "2"], "--bits-v-mean chooses V's bits in every layer"),
    (["--bits-mean", "0.5"], "--bits-mean 0.5: layers can have 1, 2, 2.5, 3, 4 bits per "
                             "element, so a mean from 1 to 4"),
    (["--bits-mean", "3", "--bits", "4", "--bits-v-mean", "2"],
     "--bits-mean chooses K's and V's bits in every layer: drop --bits, --bits-v-mean"),
    (["--bits", "2", "--bits-v-layers", "4@1"], "--bits 2 asks for K 2 / V 4 bits per element "
                                                "(Mk=8, Mv=16) in some layers (--bits-v-layers), "
                                                "which is not built"),
])
def test_bits_v_layers_errors_in_one_line(tmp_path, capsys, args, needle):
    model = tiny_model(tmp_path / "model")
    (tmp_path / "a.txt").write_text("the lazy dog " * 80)
    with pytest.raises(SystemExit) as e:
        main(["--model", model, "--text", str(tmp_path / "a.txt"), "--device", "cpu", *args])
    assert e.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]  # after the tiny model's progress
    assert line.startswith("calibrate: error: ") and needle in line, line


def test_kmeans_finds_separated_clusters_and_honours_weights():
    from vllm_pq_backend.kmeans import kmeans

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(2, 256, 2, generator=g) * 100  # 2 problems, 256 far-apart clusters
    x = centers.repeat_interleave(8, 1) + torch.randn(2, 2048, 2, generator=g) * 0.01
    c, err = kmeans(x, niter=20, seed=0)
    assert c.shape == (2, 256, 2)
    assert (err < 1e-3).all(), err  # every cluster found: only the noise is left
    # one point with all the weight among 300 random ones ends up (nearly) exact
    y = torch.randn(1, 300, 2, generator=g)
    w = torch.ones(1, 300)
    w[0, 7] = 1e6
    c, _ = kmeans(y, w, k=4, niter=10, seed=0)
    assert ((c[0] - y[0, 7]).norm(dim=-1).min() < 1e-3)


def test_balanced_axes_is_orthogonal_and_spreads_variance():
    from vllm_pq_backend.calibrate import balanced_axes

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([64.0, 32, 16, 8, 4, 2, 1, 0.5])
    x = torch.randn(5000, 1, 8, generator=g) * scales
    r = balanced_axes(x, 4)[0].float()
    assert torch.allclose(r.T @ r, torch.eye(8), atol=1e-5)
    var = (x[:, 0] @ r).var(0).log().view(4, 2).sum(1)  # log-variance per subspace
    plain = x[:, 0].var(0).log().view(4, 2).sum(1)
    assert var.max() - var.min() < 0.5 * (plain.max() - plain.min())


def test_query_metric_lowers_the_score_error():
    """K codebooks trained in the query metric make q.k errors smaller than plain L2 ones
    when queries are anisotropic (what calibrate's default K transform is for)."""
    from vllm_pq_backend.calibrate import LayerStats, Method, train_layer

    g = torch.Generator().manual_seed(0)
    n, d = 8192, 8
    k = torch.randn(n, 1, d, generator=g)
    q = torch.randn(4096, d, generator=g) * torch.tensor([8.0, 4, 1, 1, 0.25, 0.25, 0.1, 0.1])
    st = LayerStats(k=[k.half()], v=[k.half()], mass=[torch.ones(n, 1)],
                    qa=(q.T @ q).double().view(1, d, d))
    err = {}
    for name, method in {"plain": Method(k_gamma=0, k_rotate=False, v_rotate=False, v_alpha=0,
                                         niter=10),
                         "query": Method(k_gamma=1, k_rotate=True, v_rotate=False, v_alpha=0,
                                         niter=10)}.items():
        b = train_layer(st, 4, 4, method, 0, "cpu")
        t = b["k_transform"]
        kt = k if t is None else torch.einsum("nhd,hde->nhe", k, t)
        cb = b["k"]
        from vllm_pq_backend.reference import decode_codes, encode

        rec = decode_codes(encode(kt, cb), cb)
        if t is not None:
            rec = torch.einsum("nhe,hed->nhd", rec, torch.linalg.inv(t))
        err[name] = float(((k - rec)[:, 0] @ q.T).square().mean())
    assert err["query"] < 0.7 * err["plain"], err


def test_calibrate_rejects_bad_inputs_in_one_line(tmp_path, capsys):
    import pytest

    model = tiny_model(tmp_path / "model")
    with pytest.raises(SystemExit) as e:
        main(["--model", model, "--text", str(tmp_path), "--m", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "head_dim 32 supports 1 bits per element (M=4)" in err, err
    with pytest.raises(SystemExit) as e:
        main(["--model", model, "--text", str(tmp_path), "--bits", "2", "--bits-v", "4"])
    assert e.value.code == 2 and "--bits 2 --bits-v 4 asks for K 2 / V 4 bits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", model, "--text", str(tmp_path), "--m", "0"])
    assert e.value.code == 2 and "--m must be a positive integer" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope"), "--text", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0]
    assert main(["--model", model, "--text", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration text not found" in err[0]


def test_demo_without_a_gpu_says_so_in_one_line():
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    demo = os.path.join(os.path.dirname(__file__), "..", "eval", "demo.py")
    r = subprocess.run([sys.executable, demo], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "needs a CUDA GPU" in r.stderr


def test_prepare_names_what_is_missing_in_one_line(tmp_path):
    """eval/prepare.py without the SmolLM2 GGUF says where it comes from (exit 1, one line)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "eval" / "prepare.py"
    r = subprocess.run([sys.executable, str(script), "--model", str(tmp_path / "m"),
                        "--gguf-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"prepare.py: no .gguf file in {tmp_path}"]


def tiny_gpt_oss(head_std=None, **sizes):
    """A random gpt-oss: attention sinks (one learned logit per query head, far from zero
    so that they matter), a sliding-window layer and a full one, head_dim 64. Default sizes:
    16 query / 2 KV heads, window 8, two experts; ``sizes`` change them. ``head_std``: the
    output head redrawn with that deviation."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{**dict(vocab_size=300, hidden_size=64, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=2,
                                 head_dim=64, num_local_experts=2, num_experts_per_tok=1,
                                 sliding_window=8, bos_token_id=1, eos_token_id=2), **sizes},
                       layer_types=["sliding_attention", "full_attention"],
                       attn_implementation="eager")
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        if head_std:
            model.lm_head.weight.normal_(0, head_std)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    return model


def gpt_oss_model(path):
    """gpt-oss's attention (head_dim 64, 64 query / 8 KV heads, a 128-token sliding window
    on every other layer, a learned sink logit per query head) on two layers of random
    bfloat16 weights, four experts, with the tokenizer above: what vLLM serves as
    GptOssForCausalLM. The output head is scaled up for peaked next-token distributions."""
    model = tiny_gpt_oss(head_std=0.2, hidden_size=512, intermediate_size=256,
                         num_attention_heads=64, num_key_value_heads=8, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=128)
    model.to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("make", [tiny_gemma3, tiny_gpt_oss])
def test_capture_reproduces_the_models_attention(make):
    """The capture stands in for the model's attention during calibration: on a tiny Gemma 3
    (one sliding-window layer, window 8, one full layer) and a tiny gpt-oss (the same, with
    learned sink logits in every softmax) its forward equals the eager one, so the
    statistics come from the model as it really runs."""
    from transformers import AttentionInterface

    from vllm_pq_backend.calibrate import KVCapture

    model = make()
    ids = torch.randint(3, 300, (1, 40))
    with torch.no_grad():
        want = model(ids).logits
        cap = KVCapture(2, keep_fraction=0.5, seed=0, window=16)
        AttentionInterface.register(KVCapture.NAME, cap)
        model.config._attn_implementation = KVCapture.NAME
        cap.new_sequence(40)
        got = model(ids).logits
    err = (got - want).abs().amax() / want.abs().amax()
    assert err < 1e-4, err
    assert all(len(st.k) == 1 for st in cap.layers)  # both layers recorded


def _coded_split_attention(window, grads, shift=None):
    """Eager attention in which every read of key j by query i through codes (as KVCapture
    decides them: ``j < window_start(i)``, BOS aside) goes through ``k + zk`` and ``v + zv``,
    zeros kept in ``grads`` per layer: their gradients are d loss / d K, V through coded
    reads, by autograd. ``shift(layer, key, value)``: (zk, zv) instead of zeros."""
    from vllm_pq_backend.layout import window_start

    def attn(module, query, key, value, attention_mask, scaling=None, sliding_window=None,
             softcap=None, **kw):
        hq, t = query.shape[1], query.shape[2]
        g = hq // key.shape[1]
        if shift is None:
            zk, zv = (torch.zeros_like(x, requires_grad=True) for x in (key, value))
        else:
            zk, zv = shift(module.layer_idx, key, value)
        grads[module.layer_idx] = (zk, zv)
        rep = lambda x: x[0].repeat_interleave(g, 0)  # noqa: E731
        pos = torch.arange(t)
        causal = pos.view(1, -1) <= pos.view(-1, 1)
        if sliding_window:
            causal &= pos.view(1, -1) > pos.view(-1, 1) - sliding_window
        coded = pos.view(1, -1) < window_start(pos, window).view(-1, 1)
        coded[:, 0] = False
        q = query[0]
        s = torch.where(coded, q @ rep(key + zk).transpose(1, 2), q @ rep(key).transpose(1, 2))
        s = (s * scaling).masked_fill(~causal, float("-inf"))
        if kw.get("s_aux") is not None:
            sinks = kw["s_aux"].view(hq, 1, 1).expand(-1, t, 1)
            p = torch.cat([s, sinks], -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out = (p * ~coded) @ rep(value) + (p * coded) @ rep(value + zv)
        return out.transpose(0, 1)[None], None

    return attn


@pytest.mark.parametrize("make", [tiny_gemma3, tiny_gpt_oss])
def test_fisher_capture_gives_the_gradients_of_coded_reads(make):
    """capture(fisher=True) backpropagates each sequence's loss through KVCapture's own
    backward (blockwise, probabilities recomputed), the decoder layers checkpointed: on a
    tiny Gemma 3 and gpt-oss (sliding window, learned sinks) the input gradient equals eager
    attention's under autograd, the recorded rows equal d loss / d K and d loss / d V
    through coded reads only, per row, in every layer, and each layer records once."""
    from transformers import AttentionInterface

    from vllm_pq_backend.calibrate import KVCapture, _loss_backward

    model = make().float().requires_grad_(False)
    t, window = 40, 16
    ids = torch.randint(3, 300, (1, t))
    grads = {}
    AttentionInterface.register("coded_split", _coded_split_attention(window, grads))
    model.config._attn_implementation = "coded_split"
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=emb).logits[0].float()
    torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").backward()

    cap = KVCapture(2, keep_fraction=0.5, seed=0, window=window, fisher=True)
    cap.query_block = 7
    calls = []

    def counted(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return cap(module, *args, **kwargs)

    AttentionInterface.register(KVCapture.NAME, counted)
    model.config._attn_implementation = KVCapture.NAME
    with torch.no_grad():
        cap.new_sequence(1, sink_pass=True)
        model(ids[:, :1])
    cap.new_sequence(t)
    calls.clear()
    seen = []  # the leaf _loss_backward starts the graph from
    model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["inputs_embeds"]), with_kwargs=True)
    with torch.enable_grad():
        _loss_backward(model, ids)
    got = seen[0].grad
    assert ((got - emb.grad).abs() <= 1e-5 * emb.grad.abs().amax()).all()
    # the layers were checkpointed (run again in backward), and recorded once
    assert sorted(calls) == [0, 0, 1, 1] and not any(m.training for m in model.modules())
    assert all(len(getattr(st, x)) == 1 for st in cap.layers for x in ("k", "mass", "gk", "gv"))
    for i, st in enumerate(cap.layers):
        for name, z in zip(("gk", "gv"), grads[i]):
            want = z.grad[0][:, cap.rows].transpose(0, 1)  # [n, H, d]
            row = want.flatten(1).abs().amax(1).view(-1, 1, 1)
            assert want.abs().amax() > 0
            assert ((st.rows(name) - want).abs() <= 1e-4 * row + 1e-9).all(), (i, name)


@pytest.mark.parametrize("make", [tiny_gemma3, tiny_gpt_oss])
@pytest.mark.parametrize("part", ["k", "v"])
def test_measured_costs_are_the_kl_with_one_layers_part_coded(make, part):
    """measured_costs prices layer 1's K (or V) at a width by the KL divergence from the
    exact model's next-token distribution to the model's with that layer's reads through
    codes (and only those: the window and BOS exact) going through the reconstruction,
    summed over positions and divided by their count: on a tiny Gemma 3 and gpt-oss
    (sliding window, learned sinks), what eager attention gives by hand, per width; every
    candidate priced, none of a layer without candidates."""
    from transformers import AttentionInterface

    from vllm_pq_backend.calibrate import measured_costs, reconstruct

    model = make().float()
    cfg = model.config
    d, hkv, t, window = cfg.head_dim, cfg.num_key_value_heads, 40, 16
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (t,), generator=g).tolist() for _ in range(2)]
    books = {bits: (torch.randn(hkv, m, 256, d // m, generator=g) * 3,
                    torch.linalg.qr(torch.randn(hkv, d, d, generator=g))[0])
             for bits, m in ((2.0, d // 4), (4.0, d // 2))}
    other = "v" if part == "k" else "k"
    candidates = [{"k": {}, "v": {}}, {part: books, other: {4.0: books[4.0]}}]
    got = measured_costs(model, seqs, candidates, window, [True, True], "cpu", progress=False)

    def logits(bits):
        def shift(layer, key, value):
            z = [torch.zeros_like(key), torch.zeros_like(value)]
            if layer == 1 and bits is not None:
                x = (key if part == "k" else value)[0].transpose(0, 1)
                rec = reconstruct(x, *books[bits]).transpose(0, 1)[None]
                z[part == "v"] = rec - x.transpose(0, 1)[None]
            return z

        AttentionInterface.register("coded_by_hand", _coded_split_attention(window, {}, shift))
        model.config._attn_implementation = "coded_by_hand"
        with torch.no_grad():
            return [model(torch.tensor([s])).logits[0].float().log_softmax(-1) for s in seqs]

    exact = logits(None)
    for bits in books:
        kl = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(exact, logits(bits)))
        want = kl / (len(seqs) * t)
        # 1e-8: the float32 floor of a KL summed over a 300-word vocabulary
        assert want > 0 and abs(got[part][1][bits] - want) <= 1e-3 * want + 1e-8, (bits, got, want)
    assert got[other][1][4.0] > 0 and got["k"][0] == got["v"][0] == {}


def test_cost_sequences_end_every_second_one_in_a_copy_from_beyond_the_window():
    """cost_sequences: seeded picks of the calibration sequences cut to COST_SEQ_LEN; every
    second one's last eighth is an earlier span of it, which ends at least a window before
    the copy starts (so serving reads it through codes), BOS never copied."""
    from vllm_pq_backend.calibrate import COST_SEQ_LEN, COST_SEQS, cost_sequences

    seqs = [[1] + [1000 * i + j for j in range(1, 6000 if i % 3 else 300)] for i in range(12)]
    window = 128
    out = cost_sequences(seqs, window, 0)
    assert out == cost_sequences(seqs, window, 0) and len(out) == COST_SEQS
    for i, s in enumerate(out):
        n, span = len(s), len(s) // 8
        src = next(x for x in seqs if x[1] == s[1])
        assert n == min(len(src), COST_SEQ_LEN) and s[: n - span] == src[: n - span]
        if i % 2 == 0:
            assert s == src[:n]
            continue
        a = s[n - span] - src[1] + 1  # the copied span's start in the source
        assert s[n - span :] == src[a : a + span] and a >= 1 and a + span <= n - span - window
    assert cost_sequences(seqs, window, 1) != out


def test_fisher_weights_lower_the_loss_weighted_error():
    """k_fisher > 0 trains K's k-means with each row weighted per subspace by its squared
    gradient (mapped into the trained space): when a few rows carry most of the gradient,
    their error, and so the error the loss sees (sum of (g . e)^2), drops against the
    mass-weighted default."""
    from vllm_pq_backend.calibrate import LayerStats, Method, train_layer
    from vllm_pq_backend.reference import decode_codes, encode

    g = torch.Generator().manual_seed(0)
    n, d = 8192, 8
    k = torch.randn(n, 1, d, generator=g)
    grad = torch.randn(n, 1, d, generator=g) * 1e-3
    grad[: n // 16] *= 100  # a few rows the loss cares about
    st = LayerStats(k=[k.half()], v=[k.half()], mass=[torch.ones(n, 1)],
                    qa=torch.eye(d).double().view(1, d, d), gk=[grad], gv=[grad])
    err = {}
    for name, method in {"mass": Method(niter=10), "fisher": Method(k_fisher=1, niter=10)}.items():
        b = train_layer(st, 4, 4, method, 0, "cpu")
        t = b["k_transform"]
        kt = torch.einsum("nhd,hde->nhe", k.float(), t)
        rec = torch.einsum("nhe,hed->nhd", decode_codes(encode(kt, b["k"]), b["k"]),
                           torch.linalg.inv(t))
        err[name] = float(((k.half().float() - rec) * grad).sum(-1).square().sum())
    assert err["fisher"] < 0.8 * err["mass"], err
    with pytest.raises(ValueError, match="fisher"):  # CalibrationError, no gradients kept
        train_layer(LayerStats(k=st.k, v=st.v, mass=st.mass, qa=st.qa), 4, 4,
                    Method(v_fisher=1), 0, "cpu")


def test_choose_bits_holds_each_layers_rows_once_and_chooses_as_without(monkeypatch):
    """choose_bits joins and moves each layer's sampled rows once (LayerStats.held_on) for
    its several trainings and costs, lets them go after, and chooses exactly what reading
    them afresh at every use chooses."""
    import contextlib

    from vllm_pq_backend import calibrate
    from vllm_pq_backend.calibrate import LayerStats, choose_bits, cost_pairs, default_method

    g = torch.Generator().manual_seed(0)
    n, d = 2048, 32

    def layer():
        x = lambda: [torch.randn(n // 2, 2, d, generator=g).half() for _ in range(2)]  # noqa: E731
        gr = lambda: [torch.randn(n // 2, 2, d, generator=g) for _ in range(2)]  # noqa: E731
        return LayerStats(k=x(), v=x(), mass=[torch.rand(n // 2, 2, generator=g) for _ in range(2)],
                          qa=torch.eye(d).double().expand(2, d, d).clone(),
                          og=torch.eye(d).double().expand(2, d, d).clone(), gk=gr(), gv=gr())

    stats = [layer(), layer()]
    method_at = lambda mv: default_method(mv * 8 / d, niter=2)  # noqa: E731
    st = stats[0]
    with st.held_on("cpu"):
        assert st.rows("k") is st.rows("k") and torch.equal(st.rows("gv"), torch.cat(st.gv))
    assert st.held == {} and st.rows("k") is not st.rows("k")
    held = choose_bits(stats, d, cost_pairs(d), 2.5, method_at, 0, "cpu", progress=False)
    assert all(s.held == {} for s in stats)
    monkeypatch.setattr(calibrate.LayerStats, "held_on", lambda self, device: contextlib.nullcontext())
    afresh = choose_bits(stats, d, cost_pairs(d), 2.5, method_at, 0, "cpu", progress=False)
    assert held[:2] == afresh[:2]  # the same pairs, from the same costs


def test_capture_in_query_blocks_gives_the_same_statistics():
    """KVCapture computes attention a block of queries at a time (memory grows with the
    sequence, not its square): blocks of 7 queries give the forward, the attention mass of
    every sampled key and the query metric that one block over the whole sequence gives."""
    from transformers import AttentionInterface

    from vllm_pq_backend.calibrate import KVCapture

    model = tiny_gemma3()
    ids = torch.randint(3, 300, (1, 40))
    runs = []
    for block in (40, 7):
        cap = KVCapture(2, keep_fraction=0.5, seed=0, window=16)
        cap.query_block = block
        AttentionInterface.register(KVCapture.NAME, cap)
        model.config._attn_implementation = KVCapture.NAME
        with torch.no_grad():
            cap.new_sequence(1, sink_pass=True)
            model(ids[:, :1])
            cap.new_sequence(40)
            runs.append((model(ids).logits, cap.layers))
    (want, whole), (got, blocks) = runs
    assert (got - want).abs().amax() <= 1e-5 * want.abs().amax()
    for a, b in zip(whole, blocks):
        assert torch.equal(a.rows("k"), b.rows("k"))  # the same keys sampled
        x, y = a.rows("mass"), b.rows("mass")
        assert ((x - y).abs() <= 1e-5 * x.abs().amax()).all()
        assert ((a.qa - b.qa).abs() <= 1e-5 * a.qa.abs().amax()).all()
        assert a.rows("mass").sum() > 0  # keys read through codes were seen


def test_calibrate_mixes_sequence_lengths(tmp_path):
    """--seq-len 64 256: the packed text is shared out between the lengths, about the same
    tokens each, every sequence BOS first and no longer than its length; the file records
    both lengths and the evaluation scripts name the mix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    from common import calibration, codebook_meta
    from vllm_pq_backend.calibrate import mix_lengths

    seqs = mix_lengths([[1] + list(range(10, 265))] * 4, [64, 256], 1)
    assert [len(s) for s in seqs] == [64] * 4 + [256] + [64] * 4 + [256]  # 3-token tails dropped
    assert all(s[0] == 1 and 1 not in s[1:] for s in seqs)
    assert seqs[1][1:] == list(range(73, 136))  # the body goes on where the last piece ended
    model = tiny_model(tmp_path / "model")
    text = tmp_path / "a.txt"
    text.write_text(" ".join(WORDS) * 200)
    out = tmp_path / "mix.safetensors"
    assert main(["--model", model, "--text", str(text), "--m", "8", "--tokens", "2048",
                 "--seq-len", "256", "64", "--niter", "3", "--device", "cpu",
                 "--dtype", "float32", "--out", str(out)]) == 0
    meta = codebook_meta(str(out))
    assert meta["calib_seq_len"] == [64, 256]
    assert calibration(meta) == ", calibrated on 2K tokens in 64- and 256-token packed sequences"
