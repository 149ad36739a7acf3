"""Codebook files are checked, not trusted: complete metadata that agrees with the tensors,
finite centroids, finite and invertible maps, each refused with a CodebookError that names
the problem and the calibrate command."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import hf_config, random_codebooks, write_model_config
from vllm_pq_backend import codebooks
from vllm_pq_backend.config import default_codebook_path
from vllm_pq_backend.layout import NAN_CODE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model_config(str(tmp_path_factory.mktemp("model")), head_dim=32, q_heads=4,
                              kv_heads=2, layers=2)


def edited(tmp_path, model, meta=None, tensors=None, name="edited.safetensors"):
    """A file as calibration writes it (M=8, K and V maps), then ``meta(dict)`` and
    ``tensors(dict)`` applied to its metadata and tensors."""
    good = random_codebooks(str(tmp_path / "good.safetensors"), model, 8, transforms=True)
    with safe_open(good, "pt") as f:
        md = dict(f.metadata())
        ts = {k: f.get_tensor(k) for k in f.keys()}
    if meta:
        meta(md)
    if tensors:
        tensors(ts)
    path = str(tmp_path / name)
    save_file(ts, path, metadata=md)
    return path


def test_a_good_file_reads_and_loads(tmp_path, model):
    info = codebooks.read_info(edited(tmp_path, model))
    codebooks.validate(info, hf_config(model), 8, 8, model)
    k, v = codebooks.load_layer(info, 1, slice(None))
    tk, tv = codebooks.load_transforms(info, 1, slice(None))
    assert k.shape == v.shape == (2, 8, 256, 4) and tk.shape == tv.shape == (2, 32, 32)
    assert codebooks.calibration_of(info) == {}


@pytest.mark.parametrize("key", ["num_layers", "num_kv_heads", "head_dim", "m_k", "m_v",
                                 "fingerprint", "fingerprint_fields"])
def test_a_missing_metadata_key_names_itself_and_the_fix(tmp_path, model, key):
    path = edited(tmp_path, model, meta=lambda md: md.pop(key))
    with pytest.raises(codebooks.CodebookError, match=f"no '{key}'.*vllm_pq_backend.calibrate"):
        codebooks.read_info(path)


@pytest.mark.parametrize("key,value,match", [
    ("num_kv_heads", "3", r"k_centroids has shape \[2, 2, 8, 256, 4\].* says \[2, 3, 8, 256, 4"),
    ("num_layers", "4", r"k_centroids has shape \[2, 2, 8, 256, 4\].* says \[4, 2, 8, 256, 4"),
    ("m_k", "16", r"k_centroids has shape \[2, 2, 8, 256, 4\].* says \[2, 2, 16, 256, 2"),
    ("m_v", "4", r"v_centroids has shape \[2, 2, 8, 256, 4\].* says \[2, 2, 4, 256, 8"),
    ("head_dim", "64", r"fingerprint_fields says head_dim=32, the header 64"),
    ("m_k", "5", "head_dim 32 is not a multiple of its 5 subspaces"),
    ("m_v", "eight", "m_v='eight' is not an integer"),
    ("num_layers", "0", "num_layers=0 is not positive"),
    ("fingerprint_fields", "[1, 2]", "fingerprint_fields is not a JSON object"),
])
def test_metadata_must_agree_with_the_tensors(tmp_path, model, key, value, match):
    def edit(md):
        md[key] = value
        if key in ("num_kv_heads", "num_layers"):  # keep the fields consistent with it
            fields = json.loads(md["fingerprint_fields"])
            name = "num_key_value_heads" if key == "num_kv_heads" else "num_hidden_layers"
            fields[name] = int(value)
            md["fingerprint_fields"] = json.dumps(fields)

    path = edited(tmp_path, model, meta=edit)
    with pytest.raises(codebooks.CodebookError, match=match) as e:
        codebooks.read_info(path)
    assert "vllm_pq_backend.calibrate" in str(e.value)


def test_a_transform_of_the_wrong_shape_is_refused(tmp_path, model):
    def edit(ts):
        ts["k_transform"] = ts["k_transform"][:, :, :16].contiguous()

    path = edited(tmp_path, model, tensors=edit)
    with pytest.raises(codebooks.CodebookError, match=r"k_transform has shape \[2, 2, 16, 32\]"):
        codebooks.read_info(path)


def test_integer_centroids_are_refused(tmp_path, model):
    def edit(ts):
        ts["v_centroids"] = ts["v_centroids"].to(torch.int32)

    path = edited(tmp_path, model, tensors=edit)
    with pytest.raises(codebooks.CodebookError, match="v_centroids is I32, not floating point"):
        codebooks.read_info(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["k_centroids", "v_centroids"])
def test_non_finite_centroids_are_refused(tmp_path, model, name, bad):
    def edit(ts):
        ts[name][1, 0, 3, 17, 1] = bad

    info = codebooks.read_info(edited(tmp_path, model, tensors=edit))
    codebooks.load_layer(info, 0, slice(None))  # layer 0 is intact
    with pytest.raises(codebooks.CodebookError, match="layer 1's [KV] centroids hold NaN or inf"):
        codebooks.load_layer(info, 1, slice(None))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["k_transform", "v_transform"])
def test_non_finite_transforms_are_refused(tmp_path, model, name, bad):
    """A NaN map would pass a range check (NaN > max is false) and turn every query or
    output of the layer into NaN."""
    def edit(ts):
        ts[name][0, 1, 5, 7] = bad

    info = codebooks.read_info(edited(tmp_path, model, tensors=edit))
    codebooks.load_transforms(info, 1, slice(None))
    with pytest.raises(codebooks.CodebookError, match=f"layer 0's {name} hold NaN or infinity"):
        codebooks.load_transforms(info, 0, slice(None))


def test_a_singular_transform_is_refused(tmp_path, model):
    def edit(ts):
        ts["v_transform"][1, 1, :, 4] = 0  # a zero column: rank 31

    info = codebooks.read_info(edited(tmp_path, model, tensors=edit))
    with pytest.raises(codebooks.CodebookError, match="layer 1's v_transform is singular"):
        codebooks.load_transforms(info, 1, slice(None))
    with pytest.raises(codebooks.CodebookError, match="has 2 layers, asked for layer 2"):
        codebooks.load_transforms(info, 2, slice(None))


def test_unreadable_calibration_metadata_is_refused(tmp_path, model):
    path = edited(tmp_path, model, meta=lambda md: md.update(calibration="{not json"))
    with pytest.raises(codebooks.CodebookError, match="calibration is not a JSON object"):
        codebooks.calibration_of(codebooks.read_info(path))


def test_a_file_whose_nan_code_holds_a_trained_centroid_is_reported(tmp_path, model, monkeypatch):
    """Files calibrated before the marker's slot was reserved (and random ones) lose a
    centroid to it while serving: read_info says so, once per file."""
    said = []
    monkeypatch.setattr(codebooks.logger, "warning", lambda *a: said.append(a[0] % a[1:]))
    info = codebooks.read_info(edited(tmp_path, model, name="old.safetensors"))
    codebooks.read_info(info.path)
    assert len(said) == 1 and f"code {NAN_CODE} of subspace 0 holds a trained centroid" in said[0]

    def reserve(ts):
        for name in ("k_centroids", "v_centroids"):
            codebooks.reserve_nan_code(ts[name])

    said.clear()
    codebooks.read_info(edited(tmp_path, model, tensors=reserve, name="new.safetensors"))
    assert said == []


def test_v_bits_by_layer_read_back_per_layer(tmp_path, model):
    """A file whose V has 2 bits in layer 0 and 4 in layer 1 (calibrate --bits-v-layers):
    each layer loads with its own subspaces, exactly the centroids written."""
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model, 16, m_v=[8, 16], seed=3)
    info = codebooks.read_info(path)
    assert info.m_v_layers == (8, 16) and info.m_v is None and info.bits_v == 3
    codebooks.validate(info, hf_config(model), None, None, model)
    g = torch.Generator().manual_seed(3)
    torch.randn(2, 2, 16, 256, 2, generator=g)  # K, as random_codebooks draws it
    want = [torch.randn(2, mv, 256, 32 // mv, generator=g) for mv in (8, 16)]
    for layer in (0, 1):
        k, v = codebooks.load_layer(info, layer, slice(1, 2))
        assert k.shape == (1, 16, 256, 2)
        assert torch.equal(v, want[layer][1:2])
    assert info.describe() == ("K 4 / V 2 bits per element, V 4 in layer 1 (3.5 bits per "
                               "element on average; Mk=16, Mv=8, 16 in 1)")
    with pytest.raises(codebooks.CodebookError, match="Mv: file has one per layer"):
        codebooks.validate(info, hf_config(model), 16, 8, model)


def test_k_and_v_bits_by_layer_read_back_per_layer(tmp_path, model):
    """A file whose K and V have 2 bits in layer 0 and 4 in layer 1 (calibrate
    --bits-mean): each layer loads its own K and V subspaces, exactly as written; the
    file's name and description say which layers differ."""
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model, [8, 16],
                            m_v=[8, 16], seed=5)
    info = codebooks.read_info(path)
    assert (info.m_k_layers, info.m_k, info.bits_k, info.uniform) == ((8, 16), None, 3, False)
    assert info.pairs == [(8, 8), (16, 16)]
    codebooks.validate(info, hf_config(model), None, None, model)
    g = torch.Generator().manual_seed(5)
    want = {part: [torch.randn(2, m, 256, 32 // m, generator=g) for m in (8, 16)]
            for part in "kv"}
    for layer in (0, 1):
        k, v = codebooks.load_layer(info, layer, slice(1, 2))
        assert torch.equal(k, want["k"][layer][1:2]) and torch.equal(v, want["v"][layer][1:2])
    assert info.describe() == ("K 2 / V 2 bits per element, K 4 in layer 1, V 4 in layer 1 "
                               "(3 bits per element on average; Mk=8, 16 in 1, Mv=8, 16 in 1)")
    assert default_codebook_path("M", 8, 8, [8, 16], [8, 16]) == os.path.join(
        "M", "pq", "codebooks_m8_k16l1_v16l1.safetensors")
    with pytest.raises(codebooks.CodebookError, match="M: file has one per layer, K 2 / V 2"):
        codebooks.validate(info, hf_config(model), 16, None, model)


def test_v_bits_by_layer_the_kernels_lack_are_named_with_their_layers(tmp_path, model):
    path = random_codebooks(str(tmp_path / "odd.safetensors"), model, 16, m_v=[8, 32])
    with pytest.raises(codebooks.CodebookError, match=r"Mk=16, Mv=32 \(layer 1\) is not a "
                                                      "supported setting"):
        codebooks.validate(codebooks.read_info(path), hf_config(model), None, None, model)
    path = random_codebooks(str(tmp_path / "odd_k.safetensors"), model, [16, 8], m_v=16)
    with pytest.raises(codebooks.CodebookError, match=r"Mk=8, Mv=16 \(layer 1\) is not a "
                                                      "supported setting"):
        codebooks.validate(codebooks.read_info(path), hf_config(model), None, None, model)


@pytest.mark.parametrize("part", ["k", "v"])
@pytest.mark.parametrize("value,match", [
    ("[8]", r"m_{part}_layers='\[8\]' is not a list of 2 positive integers"),
    ("[8, 0]", "is not a list of 2 positive integers"),
    ("8", "is not a list of 2 positive integers"),
    ("[8, 8]", r"{part}_centroids has shape \[2, 2, 8192\].* says \[2, 2, 8, 256, 4\]"),
])
def test_bits_by_layer_metadata_must_agree(tmp_path, model, value, match, part):
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model, [8, 16], m_v=[8, 16])
    match = match.replace("{part}", part)
    with safe_open(path, "pt") as f:
        md = dict(f.metadata())
        ts = {k: f.get_tensor(k) for k in f.keys()}
    if value == "[8, 8]":  # a uniform header over the mixed tensor
        md.pop(f"m_{part}_layers")
        md[f"m_{part}"] = "8"
    else:
        md[f"m_{part}_layers"] = value
    save_file(ts, path, metadata=md)
    with pytest.raises(codebooks.CodebookError, match=match):
        codebooks.read_info(path)
