"""eval/report.py's long-calibration table: rendered from the recorded run (no GPU), every
number from the file, and a file that lacks what the table reads fails instead of
rendering a blank."""

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
import report  # noqa: E402
from common import calibration, calibration_words  # noqa: E402

RECORDED = json.loads((ROOT / "eval" / "results" / "long_calibration.json").read_text())
SHORT = "CUSTOM 4 bits, calibrated on 2K-token sequences"
DEFAULT = "CUSTOM 4 bits, calibrated on 8K-token packed sequences (default)"
MIX = "CUSTOM 4 bits, calibrated on 2K- and 8K-token packed sequences"


def render(tmp_path, monkeypatch, data) -> str:
    (tmp_path / "long_calibration.json").write_text(json.dumps(data))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    return report.TABLES["long-calibration"]()


def row(table: str, name: str, nth: int = 0) -> str:
    """The ``nth`` table row whose first cell is ``name``."""
    return [line for line in table.splitlines() if line.startswith(f"| {name} |")][nth]


def test_renders_the_recorded_run():
    table = report.TABLES["long-calibration"]()
    assert row(table, "FLASH_ATTN bf16") == "| FLASH_ATTN bf16 |  | 15.069 | 13.116 | 13.954 |  |  |  |"
    assert row(table, SHORT) == (f"| {SHORT} | 057d6f0464803dec | +0.41% | +10.55% | +49.91% "
                                 "| 95.8% | 88.0% | 71.9% |")
    assert row(table, DEFAULT) == (f"| {DEFAULT} | 69ce9c651d546cab | +1.08% | +1.86% | +1.23% "
                                   "| 94.5% | 93.2% | 95.2% |")
    assert row(table, MIX) == (f"| {MIX} | 0fea08e9cd2c411d | +0.47% | +0.64% | +1.12% "
                               "| 95.9% | 95.2% | 95.2% |")
    assert row(table, "FLASH_ATTN bf16", 1) == ("| FLASH_ATTN bf16 | 73.5 | 72.5 | 52.5 | 48.5 | 63.0 "
                                                "| 33.5 | 35.5 | 47.5 | 19.5 |")
    # against bf16: the recorded discordant counts (26 only bf16, 2 only the mix at passkey 8K)
    assert row(table, MIX, 1) == (f"| {MIX} | 78.0 (+4.5)* | 72.5 (+0.0) | 54.5 (+2.0) | 52.0 (+3.5) "
                                  "| 59.0 (-4.0) | 37.0 (+3.5) | 23.5 (-12.0)* | 40.0 (-7.5)* | 16.0 (-3.5)* |")
    # against the default: counted here from the per-prompt results
    assert row(table, MIX, 2) == (f"| {MIX} | -7.0 (17/3)* | +1.5 (13/16) | +4.5 (7/16) | -14.5 (32/3)* "
                                  "| +1.5 (16/19) | -6.0 (17/5)* | -6.0 (14/2)* | +0.5 (10/11) | -2.0 (6/2) |")
    assert len([line for line in table.splitlines() if line.startswith(f"| {DEFAULT} |")]) == 2
    for words in ("NVIDIA H200", "2026-11-29", "residual window 128", "65,536 tokens of calib.jsonl",
                  "200 prompts per task and length", "Source: `eval/results/long_calibration.json`."):
        assert words in table


def test_counts_each_prompt_against_the_default(tmp_path, monkeypatch):
    """Of the 200 prompts at one task and length, the default answers the first six, the
    mix the first one and the four after the default's: 5 only the default, 4 only the
    mix, no star (p = 1); then the mix answers none: 6 / 0, starred (p = 0.03)."""
    data = copy.deepcopy(RECORDED)
    sec = data["models"]["SmolLM2-135M"]
    default, mix = (e["label"] for e in sec["engines"][2:])
    cell = {(r["engine"], r["task"], r["length"]): r for r in sec["retrieval"]}
    rest = "0" * 190
    cell[default, "verbatim", 2048].update(correct="1111110000" + rest, accuracy=3.0)
    cell[mix, "verbatim", 2048].update(correct="1000001111" + rest, accuracy=2.5)
    assert "| -0.5 (5/4) |" in row(render(tmp_path, monkeypatch, data), MIX, 2)
    cell[mix, "verbatim", 2048].update(correct="0" * 200, accuracy=0.0)
    assert "| -3.0 (6/0)* |" in row(render(tmp_path, monkeypatch, data), MIX, 2)
    cell[mix, "verbatim", 2048].update(correct="0" * 199)
    with pytest.raises(SystemExit, match="ran different prompts at verbatim 2048"):
        render(tmp_path, monkeypatch, data)


def drop_top1(sec):
    del sec["fidelity"]["rows"][-1]["top1_agreement"]


def drop_hash(sec):
    del sec["engines"][-1]["codebook_sha256"]


def drop_answers(sec):
    del sec["retrieval"][-1]["correct"]


def drop_calibration(sec):
    del sec["engines"][-1]["calib_seq_len"]


@pytest.mark.parametrize("damage", [drop_top1, drop_hash, drop_answers, drop_calibration])
def test_a_missing_field_fails(tmp_path, monkeypatch, damage):
    data = copy.deepcopy(RECORDED)
    damage(data["models"]["SmolLM2-135M"])
    with pytest.raises(KeyError):
        render(tmp_path, monkeypatch, data)


def test_a_missing_measurement_is_named(tmp_path, monkeypatch):
    data = copy.deepcopy(RECORDED)
    sec = data["models"]["SmolLM2-135M"]
    sec["retrieval"] = [r for r in sec["retrieval"]
                        if not (r["engine"].endswith("W=128") and r["task"] == "multikey" and r["length"] == 4096)]
    with pytest.raises(SystemExit, match="'CUSTOM K4/V4 bits W=128' has no multikey at 4096"):
        render(tmp_path, monkeypatch, data)
    sec = data["models"]["SmolLM2-135M"] = copy.deepcopy(RECORDED["models"]["SmolLM2-135M"])
    sec["fidelity"]["rows"] = [r for r in sec["fidelity"]["rows"]
                               if not (r["engine"].endswith("W=128") and r["bucket"] == "2-4K")]
    with pytest.raises(SystemExit, match="'CUSTOM K4/V4 bits W=128' has no fidelity in 2-4K"):
        render(tmp_path, monkeypatch, data)


def test_codebooks_trained_differently_are_refused(tmp_path, monkeypatch):
    data = copy.deepcopy(RECORDED)
    data["models"]["SmolLM2-135M"]["engines"][-1]["calib_tokens"] = 131072
    with pytest.raises(SystemExit, match="differ in method, tokens or text"):
        render(tmp_path, monkeypatch, data)


def test_several_lengths_in_words():
    assert calibration_words(None, [2048, 8192], True) == "2K- and 8K-token packed sequences"
    assert calibration_words(65536, [2048, 4096, 8192], False) == "64K tokens in 2K-, 4K- and 8K-token sequences"
    assert calibration_words(None, [1000, 8192], True) == "1,000- and 8K-token packed sequences"


def test_a_calibration_seed_other_than_zero_is_named():
    """Two files from one command but the seed are two caches: their labels differ."""
    meta = dict(calib_tokens=131072, calib_seq_len=32768, calib_pack=True,
                calib_model_context=32768)
    assert calibration(dict(meta, calib_seed=0)) == ", calibrated on 128K tokens"
    assert calibration(dict(meta, calib_seed=1)) == ", calibrated on 128K tokens with seed 1"
    assert calibration(dict(meta, calib_tokens=65536, calib_seq_len=65536, calib_model_context=65536,
                            calib_seed=2)) == ", calibrated with seed 2"
    assert calibration(dict(meta, calib_tokens=65536, calib_seq_len=65536,
                            calib_model_context=65536)) == ""


def test_results_md_shows_the_table_as_rendered():
    text = (ROOT / "docs" / "results.md").read_text()
    begin = text.index("<!-- table: long-calibration -->\n") + len("<!-- table: long-calibration -->\n")
    assert text[begin : text.index("\n<!-- /table -->", begin)] == report.TABLES["long-calibration"]()


def test_long_window_sim_renders_every_window_of_the_recorded_run():
    """One row per window, each from its own row of the file (not copied from another)."""
    table = report.TABLES["long-window-sim"]()
    assert "| bf16 (reference) | 17.813 | 11.259 | 16.158 |" in table
    assert "| K4/V4 bits, W=0 (every key and value through codes but BOS) | +4.09% | +5.40% | +4.43% |" in table
    assert "| K4/V4 bits, W=128 | +1.41% | +2.60% | +1.14% |" in table
    assert "| K4/V4 bits, W=512 | +0.96% | +2.22% | +0.77% |" in table
    assert "sha256 bb2d6f9ebae95529" in table and "8K-token packed sequences" in table


def test_exact_sim_tables_render_each_recorded_row():
    """Every bit width's rows of the long run, and the 2K run's rows, each from its own
    row of the files, bits per element from what the row keeps exact."""
    table = report.TABLES["exact-sim-long"]()
    assert "| 4 bits | nothing more (the residual window and BOS) | 4 | +1.13% | +1.89% | +0.89% | +1.20% |" in table
    assert "| 4 bits | the 1% of K and V elements whose codes err most | 4.24 | +0.48% | +0.54% | +0.45% | +0.48% |" in table
    assert "| K4/V2 (3 bits) | the 4% of K and V elements whose codes err most | 3.96 |" in table
    assert "| 2 bits | the 1% of keys and of values whose codes err most | 2.16 | +5.42% |" in table
    assert "4 bits 89ce7c1d7216057e" in table and "2 bits b88c18acfa3b5840" in table
    short = report.TABLES["exact-sim"]()
    assert "| 4 bits | the 1% of K and V elements whose codes err most | 4.24 | +0.27 / +0.13 / +0.12 |" in short
    assert "sha256 119e34e236245205" in short and "2K-token sequences" in short


@pytest.mark.parametrize("exact, bits", [(None, "4"), ("rows:0.01", "4.16"), ("elems:0.04", "4.96"),
                                         ("vec:1", "4.38"), ("page:2", "4.25"), ("mass:16", "4.03"),
                                         ("first:16", "4.03")])
def test_exact_bits_per_element(exact, bits):
    r = dict(bits_k=4, bits_v=4, m_k=32, exact=exact)  # head_dim 64
    assert report.exact_idea(r, 8192)[1] == bits


def test_exact_sim_layouts_renders_the_recorded_run():
    table = report.TABLES["exact-sim-layouts"]()
    assert "| 4 bits | in every 128-position page, the 2 keys and the 2 values whose codes err most | 4.25 | +0.27 |" in table
    assert "| 4 bits | positions 1 to 16 | 4.12 | +0.45 |" in table
    assert "in float32, cpu" in table and "sha256 119e34e236245205" in table


def test_exact_store_table_names_each_store_by_its_bits():
    """The vLLM run with and without the exact store: rows named by bits per element with
    the store's bytes, the page's bytes in the ratio to bf16."""
    table = report.TABLES["exact-store"]()
    assert "| CUSTOM 4 bits, calibrated on 2K-token sequences | 1/4 |" in table
    assert "| CUSTOM 4 bits + 2 exact per page (4.31 bits), calibrated on 2K-token sequences | 1/3.7 |" in table
    assert "Source: `eval/results/exact_store.json`." in table


def test_long_context_rows_name_an_exact_store_and_count_its_bytes():
    e = dict(bits_k=4, bits_v=2, exact=2, bits_k_total=4.27, bits_v_total=2.27,
             calib_seq_len=32768, calib_pack=True, calib_tokens=131072, calib_model_context=32768,
             method="{}")
    assert report.long_bits(e, {}) == "3.27"
    assert report.long_bits(dict(e, exact=0), {}) == "3"
    assert "+ 2 exact per page (3.27 bits)" in report.calibrated_name(e)


def test_v_bits_by_layer_name_their_layers_and_average(tmp_path):
    """A codebook file with V bits by layer (calibrate --bits-v-layers): its rows say which
    layers differ and the bits per element it averages to, and how its other layers' V
    was trained."""
    from helpers import random_codebooks, write_model_config

    from common import codebook_meta

    model = write_model_config(str(tmp_path / "m"), head_dim=64, layers=5)
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model, 32,
                            m_v=[16, 16, 32, 32, 8])
    meta = codebook_meta(path)
    assert meta["v_layers"] == {4: "2-3", 1: "4"} and meta["bits_v_base"] == 2
    assert meta["bits_v"] == 2.6 and meta["m_v"] is None
    row = dict(meta, method=json.dumps({"v_gamma": 0.5}))
    assert report.cache_name(row) == ("CUSTOM K4/V2, V 4 in layers 2-3, V 1 in layer 4 "
                                      "(3.3 bits), V in the o_proj metric (default)")


def test_long_ablation_has_a_row_per_idea_from_its_own_run():
    table = report.TABLES["long-ablation"]()
    base = report.baseline_bits()
    for model, file, label, idea in report.ABLATION:
        section = table.split(f"**{model}**")[1].split("**")[0]
        e = next(x for x in report.long_models(file)[model]["engines"] if x["label"] == label)
        bits = report.long_bits(e, base)  # bits per element, the exact store's bytes counted
        line = next(x for x in section.splitlines() if x.startswith(f"| {bits} | {idea} |"))
        assert line.endswith(f"| `{file}` |")
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "`" in line] == [
        "| 8", "| 4", "| 4", "| 4", "| 4", "| 4", "| 3", "| 3", "| 3", "| 3", "| 2", "| 2",
        "| 8", "| 4", "| 4", "| 4", "| 4", "| 4", "| 4.27", "| 3", "| 3.27", "| 2"]
    # a cell is that cache's change against bf16 of the same file, starred past chance
    sec = report.long_models("long_bits_by_layer.json")["SmolLM2-135M"]
    label = report.ABLATION[7][2]
    r = next(r for r in sec["retrieval"] if r["engine"] == label and r["task"] == "passkey"
             and r["length"] == 2048)
    assert row(table, "3", 1).split(" | ")[3].startswith(f"{r['delta_points']:+.1f}*")


def test_long_ablation_names_a_cache_its_file_lacks(tmp_path, monkeypatch):
    data = json.loads((ROOT / "eval" / "results" / "long_bits_by_layer.json").read_text())
    data["models"]["SmolLM2-135M"]["engines"][3]["label"] = "renamed"
    for name in {f for _, f, *_ in report.ABLATION} | {"accuracy.json"}:  # + the baselines' bits
        src = ROOT / "eval" / "results" / name
        (tmp_path / name).write_text(json.dumps(data) if name == "long_bits_by_layer.json" else src.read_text())
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match="long_bits_by_layer.json has no SmolLM2-135M cache"):
        report.TABLES["long-ablation"]()


def test_files_with_ks_training_by_layer_are_named_apart_from_the_others():
    """calibrate --fit-k measured files (codebook_meta's k_fit) and the same command's files
    without it are two rows, each named for its training."""
    for name in ("k-fit-2k", "k-fit-retrieval"):
        table = report.TABLES[name]()
        assert "| CUSTOM 4 bits, K's training by layer (--fit-k measured) |" in table
        assert "| CUSTOM 4 bits |" in table
