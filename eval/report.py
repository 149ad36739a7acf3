"""The tables of README.md and docs/results.md, generated from the recorded results in
eval/results/ (pure Python: no GPU, torch or vLLM needed).

    python eval/report.py           # rewrite every table in place
    python eval/report.py --check   # exit 1, with a diff, where a table is not what the results give

A table sits in a document between two marker lines,

    <!-- table: NAME -->
    ...
    <!-- /table -->

and is the Markdown that the function registered as NAME returns. To add one: write a
function that reads its results file(s) with load() / runs() / rows() and returns the
table (and, where it helps, a line naming its source), decorate it with @table("NAME"),
and put the two marker lines where it belongs. Every number in a table comes from the
files; text around the markers is written by hand and must not repeat the numbers.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from common import calibration, calibration_words, exact_words, layer_bits_words, layer_widths, size  # eval/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "eval" / "results"
DOCUMENTS = ("README.md", "docs/results.md")
BEGIN = re.compile(r"^<!-- table: ([\w-]+) -->$")
END = "<!-- /table -->"
TABLES = {}


def table(name):
    def register(fn):
        TABLES[name] = fn
        return fn
    return register


# --- reading results -------------------------------------------------------------------


def load(name: str):
    return json.loads((RESULTS / name).read_text())


def runs(name: str) -> list[dict]:
    """A file's runs: its ``runs`` list, or the file itself as one run."""
    data = load(name)
    return data["runs"] if "runs" in data else [data]


def run(name: str, run_name: str) -> dict:
    return next(r for r in runs(name) if r.get("run") == run_name)


def run_rows(name: str, run_name: str) -> list[dict]:
    """One run's rows, each with the run's stamp filled in."""
    r = run(name, run_name)
    stamp = {k: v for k, v in r.items() if k != "rows"}
    return [dict(stamp, **row) for row in r["rows"]]


def rows(name: str) -> list[dict]:
    """Every row of a file, each with its run's stamp (device, date, ...) filled in."""
    out = []
    for r in runs(name):
        stamp = {k: v for k, v in r.items() if k not in ("rows", "runs")}
        out += [dict(stamp, **row) for row in r.get("rows", [])]
    return out


# --- formatting ------------------------------------------------------------------------


def md(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{x:+.2f}%"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def day(date: str) -> str:
    return date[:10]


def source(*files: str) -> str:
    return "Source: " + ", ".join(f"`eval/results/{f}`" for f in files) + "."


def devices(rs) -> str:
    return " / ".join(sorted({r["device"] for r in rs}))


# --- quality ---------------------------------------------------------------------------

DOMAINS = ("kernel", "fortunes", "python")


def v_training(row: dict) -> str:
    """How V was trained where it has 2 bits or fewer: calibrate's default there is V in
    the o_proj metric (vllm_pq_backend.calibrate.default_method: v_gamma 0.5)."""
    if row.get("bits_v_base", row["bits_v"]) > 2:
        return ""
    return ", V in the o_proj metric (default)" if json.loads(row["method"]).get("v_gamma") else ", V plain L2"


def fisher_words(row: dict) -> str:
    """k-means weighted by Fisher information (calibrate.Method.k_fisher / v_fisher), or ""."""
    p = json.loads(row["method"]) if row.get("method") not in (None, "plain") else {}
    k, v = p.get("k_fisher", 0), p.get("v_fisher", 0)
    power = lambda x: "" if x == 1 else f"^{x:g}"  # noqa: E731
    if not (k or v):
        return ""
    if k == v:
        return f", K and V weighted by Fisher information{power(k)}"
    return ", " + ", ".join(f"{name} weighted by Fisher information{power(x)}"
                            for name, x in (("K", k), ("V", v)) if x)


def chosen_words(row: dict) -> str:
    """Bits by layer chosen by calibration (calibrate --bits-mean, --bits-v-mean), or ""."""
    return "".join(f", chosen by calibration (--{key.replace('_', '-')} {row[key]:g})"
                   for key in ("bits_mean", "bits_v_mean") if row.get(key) is not None)


def k_fit_words(row: dict) -> str:
    """K's training chosen by layer (calibrate --fit-k measured), or ""."""
    return ", K's training by layer (--fit-k measured)" if row.get("k_fit") else ""


def custom_name(bits_k: int, bits_v: float, row: dict | None = None) -> str:
    """CUSTOM by bits per element; with ``row`` (codebook_meta's fields), the layers whose
    V bits differ from the others', and the average."""
    if row and (row.get("k_layers") or row.get("v_layers")):
        return (f"CUSTOM K{row.get('bits_k_base', bits_k)}/V{row.get('bits_v_base', bits_v)}"
                f"{layer_bits_words(row)} ({(bits_k + bits_v) / 2:g} bits)")
    if bits_k == bits_v:
        return f"CUSTOM {bits_k} bit{'' if bits_k == 1 else 's'}"
    return f"CUSTOM K{bits_k}/V{bits_v} ({(bits_k + bits_v) / 2:g} bits)"


def cache_name(row: dict) -> str:
    """A row's KV cache: a baseline's label, or CUSTOM by bits per element with how its
    codebooks were trained and calibrated where that is not the default."""
    if row.get("bits_k") in (None, 16):
        return row["label"]
    return (custom_name(row["bits_k"], row["bits_v"], row) + chosen_words(row) + exact_words(row)
            + v_training(row) + fisher_words(row) + k_fit_words(row) + calibration(row))


def quality_configs(rs: list[dict]) -> list[tuple[str, list[dict]]]:
    """(row name, rows by domain) per configuration, in the file's order."""
    out = {}
    for r in rs:
        out.setdefault(cache_name(r), []).append(r)
    return list(out.items())


def is_default(row: dict) -> bool:
    """Trained as calibrate trains by default (its calibration text and length aside:
    the row's name says those where they are not today's default)."""
    return not v_training(row).endswith("plain L2")


@table("quality-smollm2")
def quality_smollm2() -> str:
    return quality_table("accuracy.json")


@table("exact-store")
def exact_store() -> str:
    return quality_table("exact_store.json")


@table("layer-bits")
def layer_bits() -> str:
    return quality_table("layer_bits.json")


@table("quality-gemma3")
def quality_gemma3() -> str:
    return quality_table("gemma_2k.json")


@table("v-allocation")
def v_allocation() -> str:
    return quality_table("v_allocation.json", allocations())


@table("kv-allocation")
def kv_allocation() -> str:
    return quality_table("kv_allocation.json")


@table("long-bits-2k")
def long_bits_2k() -> str:
    return quality_table("long_bits_by_layer_2k.json")


@table("k-fit-2k")
def k_fit_2k() -> str:
    return quality_table("k_fit_2k.json")


@table("k-fit-k4v2-2k")
def k_fit_k4v2_2k() -> str:
    return quality_table("k_fit_k4v2_2k.json")


@table("kv-allocation-layers")
def kv_allocation_layers() -> str:
    """Each layer's K and V bits in the files whose bits calibration chose (served rows)."""
    body, seen = [], set()
    for r in load("kv_allocation.json")["rows"]:
        if not (r.get("m_k_layers") or r.get("m_v_layers")) or r["codebook_sha256"] in seen:
            continue
        seen.add(r["codebook_sha256"])
        layers = [(8 * mk / r["head_dim"], 8 * mv / r["head_dim"]) for mk, mv in layer_widths(r)]
        body.append([f"{(r['bits_k'] + r['bits_v']) / 2:g}", chosen_words(r).removeprefix(", "),
                     pairs_by_layer(layers), r["codebook_sha256"]])
    return "\n".join([md(["bits per element", "chosen", "K and V bits by layer", "codebook sha256"],
                          body), "", source("kv_allocation.json")])


def allocations(file: str = "v_allocation_sim.json") -> dict[str, dict]:
    """codebook sha256 -> the calibration of each file whose V bits calibrate chose by cost
    (--bits-v-mean), as a simulation over those files recorded it."""
    return {r["codebook_sha256"]: r["method_params"] for r in rows(file)
            if r.get("method_params", {}).get("bits_v_mean") is not None}


def quality_table(file: str, chosen: dict | None = None) -> str:
    """eval/quality.py's rows: bf16's perplexity per domain, the others' change; ``chosen``
    (allocations()) names the files whose V bits calibration chose."""
    data = load(file)
    for r in data["rows"]:
        if r.get("codebook_sha256") in (chosen or {}):
            r["bits_v_mean"] = chosen[r["codebook_sha256"]]["bits_v_mean"]
    body = []
    for name, rs in quality_configs(data["rows"]):
        by = {r["eval_text"]: r for r in rs}
        r0 = rs[0]
        base = r0["label"].startswith("FLASH_ATTN")
        cells = [f"{by[d]['ppl']:.3f}" if base else pct(by[d]["delta_pct"]) for d in DOMAINS]
        body.append([name, "1" if base else f"1/{1 / r0['bytes_per_token_vs_bf16']:.1f}".removesuffix(".0"),
                     f"{r0['kv_cache_tokens']:,}", *cells,
                     f"{100 * r0['greedy_agreement_vs_bf16']:.1f}%"])
    return "\n".join([
        md(["KV cache", "bytes/token vs bf16", "KV capacity (tokens)", "kernel", "fortunes",
            "python", "greedy = bf16"], body), "",
        f"{data['rows'][0]['model']}, {data['device']}, {day(data['date'])}; perplexity of bf16, "
        f"then the change against it; {data['docs_per_domain']} documents per domain cut at "
        f"{data['max_len']} tokens; greedy agreement over {data['greedy']}"
        + (f"; every engine's KV cache {data['kv_cache_memory_bytes'] / 1e9:g} GB "
           "(--kv-cache-memory-bytes)" if data.get("kv_cache_memory_bytes") else "")
        + ". " + source(file)])


@table("conversion")
def conversion() -> str:
    data = load("conversion_check.json")
    prov = data["provenance"]
    body = []
    for m in data["models"]:
        docs = m["tokenization_documents"]
        body.append([m["model"], m["gguf"], f"{m['tokens']:,}", f"{m['ppl_llama_cpp']:.3f}",
                     f"{m['ppl_bf16']:.3f}", f"{100 * (m['ppl_ratio'] - 1):+.2f}%",
                     f"{100 * m['top1_agreement']:.1f}%", f"{docs['equal']} of {docs['compared']}",
                     "passed" if m["passed"] else "failed"])
    return "\n".join([
        md(["model", "GGUF", "scored tokens", "perplexity, llama.cpp", "perplexity, bf16 folder",
            "bf16 vs llama.cpp", "top-1 agreement", "documents tokenized alike", "check"], body), "",
        f"{data['compute']}; llama-cpp-python {prov['llama_cpp_python']}, transformers "
        f"{prov['transformers']}, {prov['device']}, {day(prov['date'])}. The check passes at a "
        "perplexity within 2%, top-1 agreement of at least 95% and every document tokenized "
        "alike. " + source("conversion_check.json")])


SIM_LABELS = {
    "plain": "plain k-means (L2 on K and V)",
    "k_query_g1": "K: query metric, gamma 1",
    "k_query_g0.5": "K: query metric, gamma 0.5",
    "k_rotate": "K: balanced principal axes",
    "k_query_g0.5_rotate": "K: both, gamma 0.5",
    "k_query_g1_rotate": "K: both, gamma 1",
    "k_mass0.5": "K: tokens weighted by attention mass^0.5",
    "v_mass0.5": "V: tokens weighted by attention mass^0.5",
    "v_mass1": "V: tokens weighted by attention mass^1",
    "v_rotate": "V: balanced principal axes",
    "v_rotate_mass0.5": "V: balanced principal axes + mass^0.5",
    "pre_rope": "K before RoPE (RoPE pairs in one subspace)",
    "pre_rope_v_rotate_mass0.5": "K before RoPE; V: axes + mass^0.5",
    "default": "K both (gamma 0.5); V axes + mass^0.5",
    "default_k_g0.25": "the same, K gamma 0.25",
    "default_k_g0.75": "the same, K gamma 0.75",
    "default_v_o0.5": "the same + V in the o_proj metric, gamma 0.5",
    "default_v_o1": "the same + V in the o_proj metric, gamma 1",
    "default_v_o0.5_nomass": "the same + V in the o_proj metric, no mass weights",
}
BITS = ((4, 4), (4, 2), (2, 2))


def calibrate_default(params: dict, bits_v: int) -> bool:
    """Whether a simulated row trained what calibrate trains by default at these bits."""
    want = dict(k_gamma=0.5, k_rotate=True, k_alpha=0.0, v_rotate=True, v_alpha=0.5,
                v_gamma=0.5 if bits_v <= 2 else 0.0)
    return all(params.get(k, 0.0) == v for k, v in want.items())


def sim_cells(rs: list[dict]) -> str:
    by = {r["eval_text"]: r["delta_pct"] for r in rs}
    return " / ".join(f"{by[d]:+.2f}" for d in DOMAINS)


def sim_table(selected: list[tuple[str, dict]], label) -> str:
    """Rows keyed by label(run, row), columns by bits; bold where calibrate's default."""
    cells = {}
    for _, r in selected:
        key = (label(r), (r["bits_k"], r["bits_v"]))
        cells.setdefault(key, []).append(r)
    names = list(dict.fromkeys(k[0] for k in cells))
    body = []
    for n in names:
        line = [n]
        for bits in BITS:
            rs = cells.get((n, bits))
            text = sim_cells(rs) if rs else ""
            if rs and calibrate_default(rs[0]["method_params"], bits[1]):
                text = f"**{text}**"
            line.append(text)
        body.append(line)
    return md(["training", "K4/V4 (4 bits)", "K4/V2 (3 bits)", "K2/V2 (2 bits)"], body)


@table("ablations")
def ablations() -> str:
    names = ("4bit", "2bit", "2bit_b", "k4v2", "vo")
    selected = [(n, r) for n in names for r in run_rows("accuracy_sim.json", n)
                if r["method"] != "bf16"]
    order = {m: i for i, m in enumerate(SIM_LABELS)}
    selected.sort(key=lambda x: order[x[1]["method"]])
    sims = [run("accuracy_sim.json", n) for n in names]
    return "\n".join([
        sim_table(selected, lambda r: SIM_LABELS[r["method"]]), "",
        f"Perplexity change against bf16 in %, kernel / fortunes / python text; simulation "
        f"in transformers, {devices(sims)}, {day(min(s['date'] for s in sims))}; bold: what "
        "`calibrate` trains by default at those bits. " + source("accuracy_sim.json")])


@table("error-breakdown")
def error_breakdown() -> str:
    def label(r):
        part = {"kv": "K and V", "k": "only K through codes", "v": "only V through codes"}[r["quantized"]]
        return part if r["layers"] == "all" else f"K and V in layers {r['layers']} only"

    selected = [(n, r) for n in ("breakdown", "k4v2_breakdown")
                for r in run_rows("accuracy_sim.json", n) if r["method"] != "bf16"]
    return sim_table(selected, label) + "\n\n" + (
        "Perplexity change against bf16 in %, kernel / fortunes / python; simulation; each "
        "row quantizes only what it names; bold: calibrate's default training at those bits, "
        "the other cells train V in plain L2. "
        + source("accuracy_sim.json"))


@table("calibration-text")
def calibration_text() -> str:
    def label(r):
        text = ", ".join(Path(t).name for t in r["calib_text"])
        order = "shuffled documents" if r.get("shuffle_docs") else "file order"
        samples = r.get("calib_samples") or 32768
        return (f"{text}, {r['calib_tokens']:,} tokens, {samples:,} samples per head, {order}; "
                + SIM_LABELS[r["method"]].replace("the same", "default"))

    selected = [(n, r) for n in ("breakdown", "calib_shuffled", "calib_256k", "calib_mix_256k",
                                 "vgamma_mix")
                for r in run_rows("accuracy_sim.json", n)
                if r["method"] != "bf16" and r.get("quantized", "kv") == "kv"
                and r.get("layers", "all") == "all"]
    return sim_table(selected, label) + "\n\n" + (
        "Perplexity change against bf16 in %, kernel / fortunes / python; simulation; bold: "
        "calibrate's default training at those bits. "
        "`calib.jsonl` is the Python library reference; `calib_mix.jsonl` adds Perl "
        "documentation and the Jargon File. " + source("accuracy_sim.json"))


CALIBRATIONS = {
    "default4": "SmolLM2-135M, 4 bits", "default2": "SmolLM2-135M, 2 bits (V plain L2)",
    "k4v2": "SmolLM2-135M, K4/V2 (V plain L2)", "default2_vg": "SmolLM2-135M, 2 bits",
    "k4v2_vg": "SmolLM2-135M, K4/V2", "llama8b calibrate wall": "Llama-3-8B shape, 4 bits",
}


@table("calibration-time")
def calibration_time() -> str:
    text = (RESULTS / "calibrate_timing.log").read_text()
    body = [[CALIBRATIONS[m.group(1)], m.group(2)]
            for m in re.finditer(r"^(.+?) ([\d.]+) s$", text, re.M) if m.group(1) in CALIBRATIONS]
    head = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    device = re.search(r"one (NVIDIA \w+)", head).group(1)
    date = re.search(r"\d{4}-\d\d-\d\d", head).group(0)
    return md(["model, bits per element", "wall seconds"], body) + "\n\n" + (
        "`python -m vllm_pq_backend.calibrate --model MODEL --text calib.jsonl [--bits ...]` "
        f"with its other defaults, model load and forward passes included, {device}, {date}. "
        + source("calibrate_timing.log"))


# --- speed -----------------------------------------------------------------------------

SHAPE_NAMES = {"llama3-8b": "Llama-3-8B", "qwen2.5-7b": "Qwen2.5-7B", "gpt-oss": "gpt-oss"}


def ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def kernel_cell(r: dict | None) -> str:
    return "" if r is None else f"{r['custom_us']:.1f} ({ratio(r['speedup_vs_fa3'])})"


def kernel_table(run_names: list[str], mixed: bool = False) -> str:
    body = []
    selected = [run("decode_kernel.json", n) for n in run_names]
    for r in selected:
        shape = SHAPE_NAMES[r["shapes"]["model"]]
        by = {(x["context"], x["batch"], x["bits"]): x for x in r["rows"]}
        for c, b in dict.fromkeys((x["context"], x["batch"]) for x in r["rows"]):
            any_row = by.get((c, b, "4")) or by.get((c, b, "2"))
            shape_col = f"{shape}, 4K-13.8K tokens" if mixed else f"{shape}, {ctx(c)}"
            line = [shape_col, b, kernel_cell(by.get((c, b, "4"))), kernel_cell(by.get((c, b, "2"))),
                    f"{any_row['fa3_us']:.1f}"]
            if not mixed and any_row.get("turboquant_us"):
                line.append(f"{any_row['turboquant_us']:.1f}")
            body.append(line)
    header = ["shape, context", "requests", "CUSTOM 4 bits: us (x FA3)", "CUSTOM 2 bits: us (x FA3)",
              "FA3 bf16 us"]
    if any(len(line) > len(header) for line in body):
        header.append("TURBOQUANT 4bit_nc us")
        body = [line + [""] * (len(header) - len(line)) for line in body]
    return "\n".join([md(header, body), "",
                      f"{devices(selected)}, {day(selected[0]['date'])}. " + source("decode_kernel.json")])


@table("decode-kernel-h100")
def decode_kernel_h100() -> str:
    return kernel_table(["h100_llama3-8b", "h100_qwen2.5-7b"])


@table("decode-kernel-mixed")
def decode_kernel_mixed() -> str:
    return kernel_table(["h100_llama3-8b_mixed", "h100_qwen2.5-7b_mixed"], mixed=True)


@table("decode-kernel-h200")
def decode_kernel_h200() -> str:
    return kernel_table(["h200_llama3-8b", "h200_qwen2.5-7b"])


@table("decode-kernel-h200-now")
def decode_kernel_h200_now() -> str:
    return kernel_table(["h200_llama3-8b_no_tq"])


@table("decode-kernel-sinks")
def decode_kernel_sinks() -> str:
    r = run("decode_kernel.json", "h200_gpt-oss_sinks")
    by = {(x["context"], x["batch"], x["bits"]): x for x in r["rows"]}
    body = []
    for c, b in dict.fromkeys((x["context"], x["batch"]) for x in r["rows"]):
        line = [ctx(c), b]
        for bits in ("4", "2"):
            x = by[(c, b, bits)]
            change = x["custom_sinks_us"] / x["custom_us"] - 1
            line += [f"{x['custom_us']:.1f} / {x['custom_sinks_us']:.1f} ({change:+.1%})",
                     ratio(x["sinks_speedup_vs_fa3"])]
        line.append(f"{by[(c, b, '4')]['fa3_sinks_us']:.1f}")
        body.append(line)
    s = r["shapes"]
    return "\n".join([
        md(["context", "requests", "CUSTOM 4 bits: us without / with sinks", "x FA3 with sinks",
            "CUSTOM 2 bits: us without / with sinks", "x FA3 with sinks", "FA3 bf16 with sinks us"], body),
        "", f"gpt-oss's attention ({s['q_heads']} query / {s['kv_heads']} KV heads, head_dim "
        f"{s['head_dim']}), window {s['window']}, one decode step; {r['sinks_timing']}; "
        f"{r['device']}, {day(r['date'])}. " + sinks_repeat(r) + source("decode_kernel.json")])


def sinks_repeat(main: dict) -> str:
    """The cost of sinks at its largest in this run and in the repeat of the same kernel,
    so that a cell near the 3% target is read against the spread between runs."""
    def worst(r):
        x = max(r["rows"], key=lambda x: x["custom_sinks_us"] / x["custom_us"])
        return f"{x['custom_sinks_us'] / x['custom_us'] - 1:+.1%} ({ctx(x['context'])} x {x['batch']}, {x['bits']} bits)"
    rep = run("decode_kernel.json", "h200_gpt-oss_sinks_repeat")
    return (f"The largest cost of sinks: {worst(main)} here; {worst(rep)} in a repeat of the same "
            f"kernel ({rep['device']}, {day(rep['date'])}). ")


@table("decode-exact")
def decode_exact() -> str:
    """Decode with the exact store's corrections beside the kernel without them, one run."""
    r = load("decode_exact.json")
    body = []
    for x in r["rows"]:
        k, v = (x["bits"].split("/") * 2)[:2]
        body.append([ctx(x["context"]), x["batch"], custom_name(int(k), int(v)).removeprefix("CUSTOM "),
                     f"{x['custom_us']:.1f}",
                     f"{x['custom_exact_us']:.1f} ({x['custom_exact_us'] / x['custom_us']:.2f}x)",
                     f"{x['fa3_us']:.1f}"])
    s = r["shapes"]
    return "\n".join([
        md(["context", "requests", "bits per element", "CUSTOM us", f"with {r['rows'][0]['exact']} exact per page: us (x without)",
            "FA3 bf16 us"], body), "",
        f"{SHAPE_NAMES[s['model']]}'s attention ({s['q_heads']} query / {s['kv_heads']} KV heads, head_dim "
        f"{s['head_dim']}), window {s['window']}, one decode step; {r['exact_timing']}; "
        f"{r['device']}, {day(r['date'])}. " + source("decode_exact.json")])


@table("prefill")
def prefill() -> str:
    rs = load("prefill.json")["rows"]

    def key(r):
        return (r["case"], r.get("prompt_tokens"), r.get("prefix_tokens"), r.get("suffix_tokens"))

    backends = list(dict.fromkeys(r["backend"] for r in rs if r["backend"] != "FLASH_ATTN"))
    by = {(r["backend"], key(r)): r for r in rs}
    body = []
    for r in (r for r in rs if r["backend"] == "FLASH_ATTN"):
        if r["case"] == "uncached":
            what = f"uncached, {r['batch']} x {ctx(r['prompt_tokens'])}"
        elif r["case"] == "long":
            what = f"one prompt of {r['prompt_tokens']:,} tokens, in chunks of {r['max_num_batched_tokens']:,}"
        else:
            what = f"{r['batch']} prefix hits of {r['suffix_tokens']} tokens after {ctx(r['prefix_tokens'])} cached"
        line = [what, f"{r['seconds']:.3f}"]
        for b in backends:
            x = by.get((b, key(r)))
            line.append("" if x is None else f"{x['seconds']:.3f} ({ratio(x['seconds'] / r['seconds'])})")
        body.append(line)
    return "\n".join([
        md(["case", "FLASH_ATTN s", *[f"{b} s (time vs FLASH_ATTN)" for b in backends]], body), "",
        f"Llama-3-8B shape, dummy weights, {devices(rs)}, {day(rs[0]['date'])}; \"maps\": "
        "codebooks with K/V maps (random rotations). " + source("prefill.json")])


def same_run(rs: list[dict], r: dict, backend: str, **match) -> dict | None:
    """``backend``'s row of the run that made ``r`` (same git commit), matching ``match``."""
    return next((x for x in rs if x["backend"] == backend and x["git_commit"] == r["git_commit"]
                 and all(x.get(k) == v for k, v in match.items())), None)


@table("e2e")
def e2e() -> str:
    rs = load("e2e_throughput.json")["rows"]
    # a run is one git commit's rows; it is named by when its FLASH_ATTN rows were taken
    started = {r["git_commit"]: r["date"][:16].replace("T", " ") for r in rs if r["backend"] == "FLASH_ATTN"}
    order = sorted(set(started.values()), reverse=True)
    body = []
    for r in sorted(rs, key=lambda r: (r["context"], order.index(started[r["git_commit"]]),
                                       r["backend"] != "FLASH_ATTN", r["date"])):
        fa = same_run(rs, r, "FLASH_ATTN", context=r["context"])
        body.append([ctx(r["context"]), started[r["git_commit"]], r["backend"], f"{r['kv_capacity_tokens']:,}",
                     r["batch"], f"{r['decode_tok_s']:,.0f}", f"{r['step_ms']:.2f}",
                     ratio(r["decode_tok_s"] / fa["decode_tok_s"])])
    return "\n".join([
        md(["context", "run (UTC)", "backend", "KV capacity (tokens)", "requests", "decode tok/s",
            "step ms", "vs FLASH_ATTN of its run"], body), "",
        f"`LLM.generate`, Llama-3-8B shape, dummy weights, {devices(rs)}, 64 decode steps timed "
        "apart from prefill; a run is one install on one machine, its backends one after "
        "another. " + source("e2e_throughput.json")])


def serve_rate(r: dict) -> str:
    return "all at once" if r["request_rate"] == "inf" else f"{r['request_rate']}/s"


SETTINGS = ("FLASH_ATTN", "CUSTOM_4bits", "CUSTOM_2bits", "TURBOQUANT_4bit_nc")


def setting_name(s: str) -> str:
    return s.replace("CUSTOM_", "CUSTOM ").replace("bits", " bits").replace("TURBOQUANT_", "TURBOQUANT ")


@table("serve-1k")
def serve_1k() -> str:
    body = []
    srv = runs("serve_bench.json")
    for r in srv:
        fa = {x["request_rate"]: x for x in r["rows"] if x["setting"] == "FLASH_ATTN"}
        for x in sorted(r["rows"], key=lambda x: (float(x["request_rate"]), SETTINGS.index(x["setting"]))):
            base = fa[x["request_rate"]]
            body.append([r["device"], setting_name(x["setting"]), serve_rate(x),
                         f"{x['output_throughput']:,.0f}", ratio(x["output_throughput"] / base["output_throughput"], 3),
                         f"{x['median_ttft_ms']:.0f} / {x['p99_ttft_ms']:.0f}",
                         f"{x['median_tpot_ms']:.2f} / {x['p99_tpot_ms']:.2f}",
                         "" if x is base else pct(100 * (x["p99_tpot_ms"] / base["p99_tpot_ms"] - 1))])
    return "\n".join([
        md(["device", "backend", "requests", "output tok/s", "vs FLASH_ATTN", "TTFT median / p99 ms",
            "TPOT median / p99 ms", "p99 TPOT vs FLASH_ATTN"], body), "",
        "Llama-3-8B shape, dummy weights, random codebooks; 160 prompts of 1,024 tokens, 128 "
        f"output tokens each; one run per setting, {', '.join(day(r['date']) for r in srv)}. "
        + source("serve_bench.json")])


@table("serve-long")
def serve_long() -> str:
    body = []
    mixes = [r for r in runs("serve_bench_long.json") if r["run"] != "h100_prompts_only"]
    for r in mixes:
        fa = next(x for x in r["rows"] if x["setting"] == "FLASH_ATTN")
        for x in sorted(r["rows"], key=lambda x: SETTINGS.index(x["setting"])):
            body.append([r["device"], setting_name(x["setting"]), f"{x['duration']:.1f}",
                         f"{x['request_throughput']:.3f}", ratio(x["request_throughput"] / fa["request_throughput"]),
                         f"{x['output_throughput']:,.0f}",
                         f"{x['median_ttft_ms'] / 1e3:.1f} / {x['p99_ttft_ms'] / 1e3:.1f}",
                         f"{x['median_tpot_ms']:.1f} / {x['p99_tpot_ms']:.1f}"])
    prompts = run("serve_bench_long.json", "h100_prompts_only")
    pbody = [[prompts["device"], setting_name(x["setting"]), f"{x['duration']:.2f}",
              f"{x['total_input_tokens'] / x['duration']:,.0f}",
              f"{x['median_ttft_ms'] / 1e3:.1f} / {x['p99_ttft_ms'] / 1e3:.1f}"]
             for x in sorted(prompts["rows"], key=lambda x: SETTINGS.index(x["setting"]))]
    return "\n".join([
        md(["device", "backend", "seconds", "req/s", "vs FLASH_ATTN", "output tok/s",
            "TTFT median / p99 s", "TPOT median / p99 ms"], body), "",
        "The same prompts with 1-3 output tokens each (the mix's prefill alone):", "",
        md(["device", "backend", "seconds", "prompt tok/s", "TTFT median / p99 s"], pbody), "",
        "Llama-3-8B shape, dummy weights, random codebooks, `--max-model-len 16384`; 200 prompts "
        "of 4K-12K tokens, outputs of 512-1,536 tokens, all sent at once; one run per setting, "
        f"{', '.join(sorted({day(r['date']) for r in mixes}))}. " + source("serve_bench_long.json")])


def ttft_cell(r: dict | None) -> str:
    """A case's median TTFT; how many repeats its hit counters left, where not all."""
    if r is None:
        return "failed"
    if not r["valid_repeats"]:
        counts = ", ".join(f"{x['local_hits']}/{x['external_hits']}" for x in r["repeat_results"])
        return f"invalid (local/external hits {counts})"
    out = f"{r['ttft_ms_median']:,.0f}"
    return out if r["valid_repeats"] == r["repeats"] else out + f" ({r['valid_repeats']} of {r['repeats']} valid)"


@table("offload-ttft")
def offload_ttft() -> str:
    data = load("offload_ttft.json")
    body = []
    for e in data["engines"]:
        case = {r["case"]: r for r in data["rows"] if r["backend"] == e["backend"]}
        rec, host = case.get("recompute"), case.get("host")
        speedup = (ratio(rec["ttft_ms_median"] / host["ttft_ms_median"], 1)
                   if rec and host and rec["valid_repeats"] and host["valid_repeats"] else "")
        body.append([e["backend"], f"{e['bytes_per_token']:,}", ttft_cell(rec), ttft_cell(case.get("gpu")),
                     ttft_cell(host), speedup, size(host["bytes_from_host"]) if host else ""])
    return "\n".join([
        md(["KV cache", "bytes per token", "recompute (ms)", "prefix from GPU (ms)", "prefix from host (ms)",
            "recompute / host", "loaded from host per request"], body), "",
        f"Time to first token, median of {data['repeats']} repeats (vLLM's `first_token_latency`), of "
        f"a {data['prefix_tokens']:,}-token prefix plus {data['suffix_tokens']} new tokens, one "
        f"request at a time; {data['model']}, {data['weights']} weights, block {data['block_size']}, "
        f"`SimpleCPUOffloadConnector` with {data['kv_offloading_size_gib']:g} GiB of host memory; "
        f"{data['device']}, {day(data['date'])}. " + source("offload_ttft.json")])


@table("faults")
def faults() -> str:
    """What the server did, case by case; the verdict under the criteria recorded with it."""
    data = load("faults.json")
    k, n = data["kill"], data["nofit"]
    ended = ", ".join(f"{c} {what.split(':', 1)[1]}" for what, c in sorted(k["requests"].items()))
    left = "none" if not k["tree_alive_after_exit"] and not k["orphaned_gpu_pids"] else \
        f"alive {k['tree_alive_after_exit']}, GPU memory {k['orphaned_gpu_pids']}"
    body = [["engine core killed (SIGKILL) under load",
             f"exits by itself after {k['server_exit_seconds']} s, code {k['server_exit_code']}; "
             f"in-flight requests: {ended}; processes left: {left}; restarted: "
             f"{k['restart_identical']} reference outputs identical",
             "passed" if k["pass"] else "failed"],
            ["window store that cannot fit", f"exits after {n['exit_seconds']} s, code "
             f"{n['exit_code']}: {n['error'].split(':', 1)[1].strip()[:120]}...",
             "passed" if n["pass"] else "failed"]]
    return "\n".join([
        md(["case", "what the server did", "verdict"], body), "",
        f"`vllm serve` with CUSTOM, {data['model']}, {data['bits_k']} bits, {data['device']}, "
        f"{day(data['date'])}. The verdicts are those of the criteria recorded with the run: "
        f"kill: {k['criteria']}; no fit: {n['criteria']}. " + source("faults.json")])


@table("speculative")
def speculative() -> str:
    """Each case's engines without and with speculation (eval/speculative.py, a GPU run)."""
    data = load("speculative.json")
    body = []
    for r in data["rows"]:
        spec = r["speculation"] != "none"
        per_token = f"{r['target_bytes_per_token']:,.0f}" + (
            f" + {r['draft_bytes_per_token']:,.0f}" if r["draft_bytes_per_token"] else "")
        tpot = f"{r['tpot_ms_median']:.1f}" + (f" ({ratio(r['tpot_vs_without'])})" if spec else "")
        body.append([r["case"], r["backend"], r["speculation"],
                     f"{r['identical_prompts']} of {r['prompts']}" if spec else
                     f"reference (repeats itself: {r['repeats_itself']} of {r['prompts']}; "
                     f"fewest distinct tokens in an output: {r['distinct_output_tokens_min']} "
                     f"of {data['max_tokens']})",
                     *([f"{r[k]:,}" for k in ("drafts", "draft_tokens", "accepted_tokens")]
                       if spec else ["", "", ""]),
                     f"{r['kv_cache_tokens']:,}", per_token, size(r["gpu_memory_bytes"]), tpot])
    targets = "; ".join(f"{c['case']}: {c['target']}, {c['draft']}" for c in data["cases"])
    lengths = [n for c in data["cases"] for n in c["prompt_tokens"]]
    return "\n".join([
        md(["case", "target KV cache", "speculation", "greedy outputs identical", "drafts",
            "draft tokens", "accepted", "KV cache (tokens)", "bytes per token (target + draft)",
            "GPU memory held", "time per output token (ms)"], body), "",
        f"{targets}; weights drawn at random (dummy, drawn again), CUSTOM with random {data['bits_k']}-bit codebooks. "
        f"{data['prompts']} prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{data['max_tokens']} greedy tokens each, one batch, a warm-up generate before the "
        f"timed one; {data['mode']}, so the times are not those of serving with CUDA graphs. "
        + (f"KV cache {data['kv_cache_memory_bytes'] / 1e9:g} GB (--kv-cache-memory-bytes), "
           if data.get("kv_cache_memory_bytes") else "")
        + f"GPU memory utilization {data['gpu_memory_utilization']:g}, block "
        f"{data['block_size']}; {data['device']}, {day(data['date'])}. " + source("speculative.json")])


@table("soak")
def soak() -> str:
    data = load("soak.json")
    body = []
    for r in data["rows"]:
        cap = next(m.group(1) for line in r["capacity"]
                   for m in [re.search(r"KV cache size: ([\d,]+) tokens", line)] if m)
        series = r["gpu_mib_series"]
        body.append([r["backend"], cap, f"{r['requests']:,}", f"{r['ok']:,} / {r['cancelled']:,} / {r['bad_rejected']:,}",
                     r["errors_count"], "yes" if r["healthy_after"] and not r["server_exited"] else "no",
                     f"{series[0][1]:,} / {r['gpu_mib_after']:,} (+{r['gpu_mib_growth_second_half']} in the second half)",
                     f"{r['reference_identical']:,} of {r['reference']:,}"])
    cb = data["codebooks"]
    return "\n".join([
        md(["backend", "KV capacity (tokens)", "requests", "ok / cancelled / malformed (400)", "errors",
            "healthy after", "server GPU MiB: first sample / end", "greedy references identical"], body), "",
        f"{data['minutes']:g} minutes, {data['clients']} clients per server, both servers side by "
        f"side on one {data['device']} with {data['kv_cache_gib']} GiB of KV cache each, "
        f"{day(data['date'])}; CUSTOM with {cb['bits_k']}-bit codebooks calibrated on "
        f"{cb['calib_tokens']:,} tokens. " + source("soak.json")])


FEATURE_VARIANTS = {
    "no_prefix_caching": "prefix caching off", "chunked_prefill_64": "chunked prefill, 64-token budget",
    "preemption": "preemption (forced)", "enforce_eager": "`enforce_eager`",
}


def feature_cells(eager: bool) -> tuple[list[str], dict]:
    """Columns (backend, window, batch-invariant) and, per (column, variant), the latest
    run's identical outputs against that run's baseline."""
    cells = {}
    for r in sorted(runs("vllm_features.json"), key=lambda r: r["date"]):
        if bool(r.get("eager")) != eager:
            continue
        for row in r["rows"]:
            col = (row["backend"], r["window"] if row["backend"] == "CUSTOM" else None, r["batch_invariant"])
            cells[col, row["variant"]] = row["identical_to_baseline"]
    cols = list(dict.fromkeys(c for c, _ in cells))
    return cols, cells


def feature_table(eager: bool) -> str:
    cols, cells = feature_cells(eager)
    cols.sort(key=lambda c: (c[2], c[0] != "CUSTOM", c[0], -(c[1] or 0)))

    def name(c):
        backend, window, bi = c
        w = f" W={window}" if backend == "CUSTOM" else ""
        return backend + w + (", BI" if bi and not eager else "")

    body = [[label, *[cells.get((c, v), "") for c in cols]] for v, label in FEATURE_VARIANTS.items()
            if any((c, v) in cells for c in cols)]
    return md(["variant", *[name(c) for c in cols]], body)


@table("vllm-features")
def vllm_features() -> str:
    rs = runs("vllm_features.json")
    r0 = rs[0]
    return "\n".join([
        feature_table(eager=False), "",
        "With every engine eager (no torch.compile, no CUDA graphs), in batch-invariant mode:", "",
        feature_table(eager=True), "",
        f"Greedy outputs identical to the same backend's baseline, of {r0['prompts']} prompts x "
        f"{r0['gen_tokens']} tokens (SmolLM2-135M, CUSTOM 4 bits); BI: `VLLM_BATCH_INVARIANT=1`; "
        f"{devices(rs)}, {day(min(r['date'] for r in rs))}. " + source("vllm_features.json")])


@table("prefill-fidelity")
def prefill_fidelity() -> str:
    data = load("prefill_fidelity.json")
    body = [[r["backend"] + (f" W={r['window']}" if r["window"] is not None else ""),
             f"{r['bitwise_equal']} of {r['tokens']}", f"{r['mean_abs_diff']:.3f} / {r['max_abs_diff']:.2f}"]
            for r in data["rows"]]
    return "\n".join([
        md(["backend", "bitwise equal", "mean / max difference (nats)"], body), "",
        f"{len(data['prompt_lens'])} prompts of {min(data['prompt_lens'])}-{max(data['prompt_lens'])} "
        f"tokens, {data['gen_tokens']} greedy tokens each, batch-invariant mode, eager engines, "
        f"{data['device']}, {day(data['date'])}. " + source("prefill_fidelity.json")])


# each log of eval/lm_eval/entrypoints.sh, and what it ran
ENTRY_LOGS = {
    "entrypoints.log": "SmolLM2-135M",
    "entrypoints_eagle3.log": "SmolLM2-135M with an EAGLE-3 draft (dummy weights, on FLASH_ATTN)",
    "entrypoints_gpt_oss.log": "gpt-oss attention: sinks, sliding window (2 random layers)",
    "entrypoints_qwen3.log": "Qwen3-8B attention: QK-norm (2 random layers)",
}


@table("entrypoints")
def entrypoints() -> str:
    body, logs = [], [log for log in ENTRY_LOGS if (RESULTS / log).exists()]  # a row per run
    for log in logs:
        model, text = ENTRY_LOGS[log], (RESULTS / log).read_text()
        head = re.match(r"date: (\S+)\s+device: (.+)", text)
        completion = re.search(r"^completion: (?!failed)(.+)$", text, re.M)
        generated = re.findall(r"^generate: ", text, re.M)
        scores, metric = {}, None
        for part in text.split("== 3. lm_eval")[1:]:
            m = re.search(r"attention_backend=(\w+)(?:.*\n)*?^\|(\w+)\s*\|[^|]*\|[^|]*\|[^|]*\|"
                          r"(\w+)\s*\|[^|]*\|\s*([\d.]+)", part, re.M)
            scores[m.group(1)] = m.group(4)
            metric = f"{m.group(2)} {m.group(3)}"
        body.append([model, head.group(2), day(head.group(1)), completion.group(1) if completion else "failed",
                     f"{len(generated)} prompts",
                     f"{metric}: {scores.get('CUSTOM', 'failed')} / {scores.get('FLASH_ATTN', 'failed')}"])
    note = ("The random models complete with noise; their rows show that each entry point "
            "serves them, and CUSTOM's `lm_eval` score beside FLASH_ATTN's. "
            if any("random" in row[0] for row in body) else "")
    return "\n".join([
        md(["model", "device", "date", "`vllm serve` completion of \"The capital of France is\"",
            "`LLM.generate`", "`lm_eval`, CUSTOM / FLASH_ATTN"], body), "",
        note + source(*logs)])


@table("demo")
def demo() -> str:
    text = (RESULTS / "demo.log").read_text()
    prov = json.loads(re.search(r"^provenance: (.+)$", text, re.M).group(1))
    body = [[m.group(1), m.group(2), m.group(3), m.group(4)] for m in re.finditer(
        r"^(FLASH_ATTN bf16|CUSTOM \d bits)\s+([\d.]+(?: \([^)]*\))?)\s+([\d,]+(?:\s+\([\d.]+x\))?)\s+([\d,]+)$",
        text, re.M)]
    for row in body:
        row[2] = re.sub(r"\s+", " ", row[2])
    return "\n".join([
        md(["backend", "perplexity", "KV capacity (tokens)", "decode tok/s"], body), "",
        f"`python eval/demo.py`, {prov['device']}, {day(prov['date'])}. " + source("demo.log")])


# --- long context ----------------------------------------------------------------------

LONG_REF = "FLASH_ATTN bf16"


def long_models(file: str = "long_context.json") -> dict:
    return load(file)["models"]


def baseline_bits() -> dict:
    """Bits per element of the baselines' formats, from the capacity vLLM gave them in the
    three-domain run (accuracy.json)."""
    out = {}
    for r in load("accuracy.json")["rows"]:
        if r.get("bits_k") in (None, 16):
            out[r["label"]] = f"{16 * r['bytes_per_token_vs_bf16']:.1f}".removesuffix(".0")
    return out


def long_bits(e: dict, base: dict) -> str:
    """Bits per element of K and V, an exact store's bytes included."""
    if e.get("bits_k") in (None, 16):
        return base.get(e["label"], "?")
    if exact_words(e):
        return f"{(e['bits_k_total'] + e['bits_v_total']) / 2:.2f}"
    return f"{(e['bits_k'] + e['bits_v']) / 2:g}"


def long_cells(sec: dict, e: dict, length: int) -> list[str]:
    """Retrieval accuracy per task at ``length``: bf16's in %, others' change in points."""
    out = []
    for task in ("passkey", "multikey", "verbatim"):
        r = retrieval(sec, e, task, length)
        if r is None:
            out.append("")
        elif "delta_points" in r:
            out.append(f"{r['accuracy']:.1f}% ({r['delta_points']:+.1f})")
        else:
            out.append(f"{r['accuracy']:.1f}%")
    return out


def retrieval(sec: dict, e: dict, task: str, length: int) -> dict | None:
    return next((r for r in sec["retrieval"] if r["engine"] == e["label"] and r["task"] == task
                 and r["length"] == length), None)


def fidelity(sec: dict, e: dict, bucket: str) -> dict | None:
    return next((r for r in sec["fidelity"]["rows"] if r["engine"] == e["label"] and r["bucket"] == bucket), None)


def long_note(sec: dict, model: str) -> str:
    f = sec["fidelity"]
    return (f"{model}, {sec['device']}, {day(sec['date'])}: {sec['samples_per_task_length']} "
            f"prompts per task and length over a haystack of {' + '.join(sec['haystack'])}, the "
            f"same token ids for every cache (set {sec['prompt_set_sha256']}); fidelity over "
            f"{f['docs']} documents of {f['tokens_per_doc']:,} tokens of {' + '.join(f['text'])}.")


def short_calibration(e: dict, length: int) -> bool:
    """Codebooks calibrated on sequences shorter than ``length`` tokens (the longest of a
    mix of lengths)."""
    seq = e.get("calib_seq_len") or length
    return (seq if isinstance(seq, int) else max(seq)) < length


@table("long-context")
def long_context() -> str:
    """The README's: each model at its longest length, every cache that serves it
    (codebooks calibrated on sequences at least that long; the others in docs/results.md)."""
    base = baseline_bits()
    body, notes = [], []
    for model, sec in long_models().items():
        longest = max(sec["lengths"])
        buckets = [r["bucket"] for r in sec["fidelity"]["rows"] if r["engine"] == LONG_REF]
        first, far = buckets[0], buckets[-1]
        for e in sec["engines"]:
            if "error" in e or short_calibration(e, longest):
                continue
            ref = e["label"] == LONG_REF
            f0, f1 = fidelity(sec, e, first), fidelity(sec, e, far)
            gap = "reference" if ref else f"{pct(f0['delta_pct'])} / {pct(f1['delta_pct'])}"
            top1 = "" if ref else f"{100 * f1['top1_agreement']:.1f}%"
            name = custom_name(e["bits_k"], e["bits_v"]) + exact_words(e) + calibration(e) \
                if e.get("bits_k") not in (None, 16) and is_default(e) else cache_name(e)
            body.append([f"{model}, {longest // 1024}K", name, long_bits(e, base),
                         *long_cells(sec, e, longest), gap, top1])
        notes.append(long_note(sec, model))
    return "\n".join([
        md(["model, prompt length", "KV cache", "bits per element", "passkey", "multikey", "verbatim",
            "perplexity vs bf16: first / farthest bucket", "top-1 = bf16, farthest bucket"], body), "",
        "Retrieval: bf16's accuracy, then each cache's with its change in points. " + " ".join(notes)
        + " " + source("long_context.json")])


@table("lm-eval-long")
def lm_eval_long() -> str:
    """The pq_long tasks through `lm_eval --model vllm` (eval/lm_eval/pq_long.py), each
    beside the harness's accuracy for the same cache on the same prompts
    (long_context.json), where it has that cache."""
    data = load("lm_eval_long.json")
    sec = long_models().get(data["model"])
    lengths = sorted({int(n) for r in data["rows"] for acc in r["accuracy"].values() for n in acc})
    body, other = [], False
    for r in data["rows"]:
        label = r["name"] if r.get("bits_k") is None else cache_name(r)
        engine = next((e for e in (sec or {}).get("engines", []) if e["label"] == r["name"]), None)
        other |= engine is not None and engine.get("codebook_sha256") != r.get("codebook_sha256")
        for task, acc in r["accuracy"].items():
            cells = []
            for n in lengths:
                h = retrieval(sec, engine, task, n) if engine else None
                cells.append("" if str(n) not in acc else f"{100 * acc[str(n)]:.1f}" +
                             (f" ({h['accuracy']:.1f})" if h else ""))
            body.append([label, task, *cells])
    return "\n".join([
        md(["KV cache", "task", *(f"{n // 1024}K" for n in lengths)], body), "",
        f"{data['model']}, {data['device']}, {day(data['date'])}: `lm_eval` accuracy in %, in brackets "
        "eval/long_context.py's for the same cache on the same prompts as token ids"
        + (" (CUSTOM: other codebooks from the same calibration command)" if other else "")
        + ". " + source("lm_eval_long.json", "long_context.json")])


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test of ``a`` against ``b`` discordant pairs (McNemar's exact
    test): the chance of a split at least this uneven if either answer were as likely."""
    from math import comb

    n = a + b
    return min(1.0, 2 * sum(comb(n, i) for i in range(min(a, b) + 1)) / 2 ** n) if n else 1.0


@table("long-context-retrieval")
def long_context_retrieval() -> str:
    return retrieval_table("long_context.json")


@table("kv-allocation-retrieval")
def kv_allocation_retrieval() -> str:
    return retrieval_table("long_allocation.json")


# (model, results file, engine label, the idea the row measures): the
# served long-context runs, one row per idea, each against bf16 of its own run
ABLATION = [
    ("SmolLM2-135M", "long_context.json", "fp8", "fp8 (anchor)"),
    ("SmolLM2-135M", "long_calibration.json", "CUSTOM K4/V4 bits W=128, calibrated on 2K-token sequences",
     "codebooks from 2K-token sequences"),
    ("SmolLM2-135M", "long_calibration.json", "CUSTOM K4/V4 bits W=128",
     "from 8K-token packed sequences (the default)"),
    ("SmolLM2-135M", "long_calibration.json",
     "CUSTOM K4/V4 bits W=128, calibrated on 2K- and 8K-token packed sequences",
     "from 2K- and 8K-token sequences"),
    ("SmolLM2-135M", "long_k_fit.json", "CUSTOM K4/V4 bits W=128", "the default, calibrated again"),
    ("SmolLM2-135M", "long_k_fit.json", "CUSTOM K4/V4 bits, K's training by layer W=128",
     "K's training by layer (--fit-k measured), the same calibration otherwise"),
    ("SmolLM2-135M", "long_context.json", "CUSTOM K4/V2 bits W=128", "K4/V2, the default calibration"),
    ("SmolLM2-135M", "long_bits_by_layer.json",
     "CUSTOM K4/V2 bits W=128, calibrated on 2K- and 8K-token packed sequences",
     "K4/V2, from 2K- and 8K-token sequences"),
    ("SmolLM2-135M", "long_bits_by_layer.json", "CUSTOM K4/V1 bits, V 4 in layers 8,14,17-18,20,23-24, "
     "V 2 in layers 7,12,15-16,19,21-22,26,28 W=128, calibrated on 2K- and 8K-token packed sequences",
     "V's bits by layer (--bits-v-mean 2), from 2K- and 8K-token sequences"),
    ("SmolLM2-135M", "long_bits_by_layer.json", "CUSTOM K4/V2 bits, K 2 in layers 0,11,25,27,29, V 4 in "
     "layers 8,14,17-18,20,23-24, V 1 in layers 1,3,9-10 W=128, calibrated on 2K- and 8K-token packed "
     "sequences", "K's and V's bits by layer (--bits-mean 3), from 2K- and 8K-token sequences"),
    ("SmolLM2-135M", "long_context.json", "CUSTOM K2/V2 bits W=128", "2 bits, the default calibration"),
    ("SmolLM2-135M", "long_bits_by_layer.json", "CUSTOM K2/V2 bits, K 4 in layers 2,5,7-8,14-15,18,20,"
     "23-24, K 1 in layers 0,11,13,16,25,27,29, V 1 in layers 0,2,5,7-8,11,13,15-16,24-25,27,29 W=128, "
     "calibrated on 2K- and 8K-token packed sequences",
     "K's and V's bits by layer (--bits-mean 2), from 2K- and 8K-token sequences"),
    ("Gemma-3-270M", "long_context.json", "fp8", "fp8 (anchor)"),
    ("Gemma-3-270M", "long_context.json", "CUSTOM K4/V4 bits W=128, calibrated on 2K-token sequences",
     "codebooks from 2K-token sequences"),
    ("Gemma-3-270M", "long_context.json", "CUSTOM K4/V4 bits W=128, calibrated on 128K tokens",
     "from 32K-token packed sequences (the default)"),
    ("Gemma-3-270M", "long_gemma_calibration.json", "CUSTOM K4/V4 bits W=128, calibrated on 128K tokens",
     "the same command again"),
    ("Gemma-3-270M", "long_gemma_calibration.json",
     "CUSTOM K4/V4 bits W=128, calibrated on 128K tokens with seed 1", "the same command, seed 1"),
    ("Gemma-3-270M", "long_gemma_calibration.json",
     "CUSTOM K4/V4 bits W=128, calibrated on 128K tokens in 4K- and 32K-token packed sequences",
     "from 4K- and 32K-token sequences"),
    ("Gemma-3-270M", "long_exact.json", "CUSTOM K4/V4 bits + 2 exact per page (4.27 bits) W=128, "
     "calibrated on 128K tokens", "the default + the exact store, 2 keys and values per page"),
    ("Gemma-3-270M", "long_context.json", "CUSTOM K4/V2 bits W=128, calibrated on 128K tokens",
     "K4/V2, the default calibration"),
    ("Gemma-3-270M", "long_exact.json", "CUSTOM K4/V2 bits + 2 exact per page (3.27 bits) W=128, "
     "calibrated on 128K tokens", "K4/V2 + the exact store, 2 keys and values per page"),
    ("Gemma-3-270M", "long_context.json", "CUSTOM K2/V2 bits W=128, calibrated on 128K tokens",
     "2 bits, the default calibration"),
]


@table("long-ablation")
def long_ablation() -> str:
    """What each idea is worth at each length: one row per served configuration (ABLATION),
    its perplexity change by distance and its retrieval change per length, each against
    bf16 in its own run."""
    base, out, files = baseline_bits(), [], []
    for model in dict.fromkeys(m for m, *_ in ABLATION):
        body, lengths, buckets = [], None, None
        for _, file, label, idea in (a for a in ABLATION if a[0] == model):
            sec = long_models(file)[model]
            e = next((x for x in sec["engines"] if x["label"] == label), None)
            if e is None:
                raise SystemExit(f"report.py: {file} has no {model} cache {label!r}")
            lengths = lengths or sec["lengths"]
            buckets = buckets or [r["bucket"] for r in sec["fidelity"]["rows"] if r["engine"] == LONG_REF]
            files.append(file)
            gaps = " / ".join(pct(fidelity(sec, e, b)["delta_pct"]) for b in buckets)
            cells = []
            for n in lengths:
                rs = [retrieval(sec, e, t, n) for t in ("passkey", "multikey", "verbatim")]
                cells.append(" / ".join("not run" if r is None else starred(
                    f"{r['delta_points']:+.1f}", r["only_bf16"], r["only_this"]) for r in rs))
            body.append([long_bits(e, base), idea, gaps, *cells, f"`{file}`"])
        out += [f"**{model}**", "", md(["bits per element", "what changes",
                                         f"perplexity vs bf16, {' / '.join(buckets)}",
                                         *(f"passkey / multikey / verbatim, {n // 1024}K" for n in lengths),
                                         "source"], body), ""]
    return "\n".join(out + [
        "Each row against bf16 in its own run, on the same prompts and documents (prompt sets as "
        "in the tables above); retrieval changes in points, * beyond chance (two-sided sign test, "
        "p < 0.05). Source: " + ", ".join(f"`eval/results/{f}`" for f in dict.fromkeys(files)) + "."])


@table("needle-errors")
def needle_errors() -> str:
    """Each codebook file's relative coding error of K and V at a passkey needle's digits
    and in the haystack (eval/needle_errors.py), mean over layers and the layer where the
    digits' is furthest above the haystack's."""
    data = load("needle_errors.json")
    body = []
    for meta in data["codebooks"]:
        cells = []
        for part in "kv":
            rs = [r for r in data["rows"] if r["codebook_sha256"] == meta["codebook_sha256"] and r["part"] == part]
            mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
            worst = max(rs, key=lambda r: r["digits"] / r["haystack"])
            cells += [f"{100 * mean('digits'):.2f}% / {100 * mean('haystack'):.2f}%",
                      f"{worst['layer']}: {100 * worst['digits']:.2f}% / {100 * worst['haystack']:.2f}%"]
        body.append([custom_name(meta["bits_k"], meta["bits_v"]) + calibration(meta), *cells,
                     meta["codebook_sha256"]])
    return "\n".join([
        md(["codes", "K: digits / haystack", "K: layer furthest above", "V: digits / haystack",
            "V: layer furthest above", "codebook sha256"], body), "",
        f"Relative coding error ||x - x_hat||^2 / ||x||^2, mean over layers and KV heads, at the "
        f"needle's digits ({data['digit_tokens']:,} tokens) and at the haystack's tokens "
        f"({data['haystack_tokens']:,}) of {data['prompts']} passkey prompts of {data['length']:,} "
        f"tokens as eval/long_context.py makes them; then the layer where the digits' error is "
        f"furthest above the haystack's. The model of `{data['model']}`, unquantized in "
        f"transformers, {data['device']}, {day(data['date'])}. " + source("needle_errors.json")])


@table("layer-kl")
def layer_kl() -> str:
    return layer_kl_table("layer_kl.json")


@table("layer-kl-fit")
def layer_kl_fit() -> str:
    return layer_kl_table("layer_kl_fit.json")


def layer_kl_table(file: str) -> str:
    """Each codebook file's KL from the exact model's next-token distribution with every part
    coded, and with each layer's K or V coded alone (eval/layer_kl.py): the sums over
    layers and the parts that cost most."""
    data = load(file)
    body = []
    for meta in data["codebooks"]:
        rs = [r for r in data["rows"] if r["codebook_sha256"] == meta["codebook_sha256"]]
        whole = next(r["kl"] for r in rs if r["layer"] is None)
        parts = [r for r in rs if r["layer"] is not None]
        total = sum(r["kl"] for r in parts)
        part_sum = {p: sum(r["kl"] for r in parts if r["part"] == p) for p in "kv"}
        top = sorted(parts, key=lambda r: -r["kl"])[:5]
        body.append([custom_name(meta["bits_k"], meta["bits_v"]) + k_fit_words(meta)
                     + calibration(meta), f"{whole:.5f}", f"{total:.5f}",
                     f"{part_sum['k']:.5f} ({100 * part_sum['k'] / total:.0f}%)",
                     f"{part_sum['v']:.5f} ({100 * part_sum['v'] / total:.0f}%)",
                     ", ".join(f"{r['part'].upper()} of layer {r['layer']} "
                               f"{100 * r['kl'] / total:.0f}%" for r in top),
                     meta["codebook_sha256"]])
    return "\n".join([
        md(["codes", "KL, every part coded", "KL summed over parts coded alone", "K's",
            "V's", "the parts that cost most (share of the sum)", "codebook sha256"], body), "",
        f"KL divergence from the exact model's next-token distribution, per position, over "
        f"{data['positions']:,} positions of {data['docs']} documents of "
        f"{data['length']:,} tokens of {', '.join(data['text'])} (text the codebooks never "
        f"saw); window {data['window']}. The model of `{data['model']}` in {data['dtype']} in "
        f"transformers with the backend's reads simulated (eval/accuracy_sim.py), "
        f"{data['device']}, {day(data['date'])}. " + source(file)])


@table("k-fit-retrieval")
def k_fit_retrieval() -> str:
    return retrieval_table("long_k_fit.json")


@table("k-fit-fidelity")
def k_fit_fidelity() -> str:
    return fidelity_table("long_k_fit.json")


@table("long-bits-retrieval")
def long_bits_retrieval() -> str:
    return retrieval_table("long_bits_by_layer.json")


@table("long-gemma-calibration-retrieval")
def long_gemma_calibration_retrieval() -> str:
    return retrieval_table("long_gemma_calibration.json")


@table("long-exact-retrieval")
def long_exact_retrieval() -> str:
    return retrieval_table("long_exact.json")


def retrieval_table(file: str) -> str:
    """Per model: bf16's retrieval accuracy per task and length, the others' change."""
    out = []
    for model, sec in long_models(file).items():
        tasks = [t for t in ("passkey", "multikey", "verbatim") if any(r["task"] == t for r in sec["retrieval"])]
        cols = [(t, n) for n in sec["lengths"] for t in tasks]
        body = []
        for e in sec["engines"]:
            if "error" in e:
                body.append([cache_name(e), "failed: " + e["error"][:60]] + [""] * (len(cols) - 1))
                continue
            row = [cache_name(e)]
            for t, n in cols:
                r = retrieval(sec, e, t, n)
                row.append("" if r is None else f"{r['accuracy']:.1f}" if "delta_points" not in r
                           else starred(f"{r['delta_points']:+.1f} ({r['only_bf16']}/{r['only_this']})",
                                        r["only_bf16"], r["only_this"]))
            body.append(row)
        out += [f"**{model}**", "", md(["KV cache"] + [f"{t} {n // 1024}K" for t, n in cols], body), ""]
        out += [store_against_none(sec, cols), ""] if any(e.get("exact") for e in sec["engines"]) else []
    return "\n".join(out + ["bf16's accuracy in %, then each cache's change in points against it "
                            "on the same prompts, and in brackets the prompts only bf16 / only "
                            "this cache answered; * marks a change beyond chance (two-sided sign "
                            "test on those two counts, p < 0.05). " + source(file)])


def store_against_none(sec: dict, cols: list[tuple[str, int]]) -> str:
    """Each cache with an exact store against the same codebooks without one, paired on
    the same prompts: the cells that change beyond chance, and the most uneven one."""
    words = []
    for e in (e for e in sec["engines"] if e.get("exact") and "error" not in e):
        plain = next(x for x in sec["engines"] if x.get("codebook_sha256") == e["codebook_sha256"]
                     and not x.get("exact") and "error" not in x)
        splits = []
        for t, n in cols:
            lost, won = only_each(retrieval(sec, plain, t, n), retrieval(sec, e, t, n))
            splits.append((sign_test(lost, won), f"{t} {n // 1024}K {lost}/{won}"))
        beyond = sum(p < 0.05 for p, _ in splits)
        p, where = min(splits)
        words.append(f"{cache_name(e)}: {beyond} of {len(splits)} cells beyond chance (most "
                     f"uneven: {where}, p = {p:.2f})")
    return ("Each store against the same codebooks without it, on the same prompts (prompts "
            "only without / only with the store): " + "; ".join(words) + ".")


def calibrated_name(e: dict) -> str:
    """A CUSTOM row by its bits and how its codebooks were calibrated, the default named too."""
    words = calibration(e) or (", calibrated on " + calibration_words(
        None, e["calib_seq_len"], e["calib_pack"]) + " (default)")
    return custom_name(e["bits_k"], e["bits_v"]) + exact_words(e) + words


def only_each(a: dict, b: dict) -> tuple[int, int]:
    """The prompts only ``a`` answered and only ``b`` answered, from their per-prompt
    results on the same prompts."""
    if len(a["correct"]) != len(b["correct"]):
        raise SystemExit(f"report.py: {a['engine']!r} and {b['engine']!r} ran different prompts "
                         f"at {a['task']} {a['length']}")
    pairs = list(zip(a["correct"], b["correct"]))
    return pairs.count(("1", "0")), pairs.count(("0", "1"))


def starred(text: str, only_a: int, only_b: int) -> str:
    return text + ("*" if sign_test(only_a, only_b) < 0.05 else "")


@table("long-calibration")
def long_calibration() -> str:
    """One size of codebooks calibrated on sequences of different lengths, side by side in
    vLLM (eval/long_context.py): perplexity and top-1 agreement with bf16 by position,
    retrieval per task and length, and each non-default calibration against the default
    prompt by prompt."""
    out = []
    for model, sec in load("long_calibration.json")["models"].items():
        engines = sec["engines"]
        ref = next(e for e in engines if e["label"] == LONG_REF)
        customs = [e for e in engines if e is not ref]
        default = next((e for e in customs if not calibration(e)), None)
        buckets = [r["bucket"] for r in sec["fidelity"]["rows"] if r["engine"] == LONG_REF]
        tasks = list(dict.fromkeys(r["task"] for r in sec["retrieval"]))
        cols = [(t, n) for n in sec["lengths"] for t in tasks]
        if len({(e["method"], e["calib_tokens"], tuple(e["calib_text"])) for e in customs}) > 1:
            raise SystemExit("report.py: long_calibration.json: the codebooks differ in method, "
                             "tokens or text; calibrate them alike but for --seq-len / --pack")

        def need(r, e, what):
            if r is None:
                raise SystemExit(f"report.py: long_calibration.json: {e['label']!r} has no {what}")
            return r

        def ret(e, t, n):
            return need(retrieval(sec, e, t, n), e, f"{t} at {n}")

        def fid(e, b):
            return need(fidelity(sec, e, b), e, f"fidelity in {b}")

        fids = [[LONG_REF, "", *(f"{fid(ref, b)['ppl']:.3f}" for b in buckets), *[""] * len(buckets)]]
        acc = [[LONG_REF, *(f"{ret(ref, t, n)['accuracy']:.1f}" for t, n in cols)]]
        paired = []
        for e in customs:
            rs = [fid(e, b) for b in buckets]
            fids.append([calibrated_name(e), e["codebook_sha256"], *(pct(r["delta_pct"]) for r in rs),
                        *(f"{100 * r['top1_agreement']:.1f}%" for r in rs)])
            acc.append([calibrated_name(e)] + [
                starred(f"{r['accuracy']:.1f} ({r['delta_points']:+.1f})", r["only_bf16"], r["only_this"])
                for r in (ret(e, t, n) for t, n in cols)])
            if default is not None and e is not default:
                row = [calibrated_name(e)]
                for t, n in cols:
                    a, b = ret(default, t, n), ret(e, t, n)
                    only_d, only_e = only_each(a, b)
                    row.append(starred(f"{b['accuracy'] - a['accuracy']:+.1f} ({only_d}/{only_e})", only_d, only_e))
                paired.append(row)
        windows = ", ".join(sorted({str(e["window"]) for e in customs}))
        texts = " + ".join(Path(t).name for t in customs[0]["calib_text"])
        out += [
            f"**{model}: perplexity by position**", "",
            md(["KV cache", "codebooks (sha256)", *(f"perplexity {b}" for b in buckets),
                *(f"top-1 = bf16 {b}" for b in buckets)], fids), "",
            "bf16's perplexity per position bucket, then each cache's change against it, and the "
            "share of positions whose top-1 prediction is bf16's.", "",
            f"**{model}: retrieval**", "",
            md(["KV cache", *(f"{t} {n // 1024}K" for t, n in cols)], acc), "",
            "Accuracy in %, each cache's change against bf16 in points in brackets; * marks a change "
            "beyond chance (two-sided sign test on the prompts only one of the two answered, p < 0.05).", ""]
        if paired:
            out += [
                f"**{model}: against the default codebooks, prompt by prompt**", "",
                md(["codebooks", *(f"{t} {n // 1024}K" for t, n in cols)], paired), "",
                f"Change in points against {calibrated_name(default)} on the same prompts, in "
                "brackets the prompts only the default / only these codebooks answered; * as above.", ""]
        out.append(f"CUSTOM: K and V at the bits per element each row names, residual window "
                   f"{windows}; every codebook file trained alike on "
                   f"{customs[0]['calib_tokens']:,} tokens of {texts}, "
                   f"only the sequences differing. {long_note(sec, model)}")
    return "\n".join(out + ["", source("long_calibration.json")])


def sim_by_position(name: str, label) -> tuple:
    """A simulation's perplexity by position (accuracy_sim.py --long): its rows other than
    bf16's, their buckets, the table body (bf16's perplexity per bucket, then each other
    row's change against it, named by ``label(row)``) and the caption's first sentence."""
    data = load(name)
    ref = next(r for r in data["rows"] if r["method"] == "bf16")
    rows = [r for r in data["rows"] if r["method"] != "bf16"]
    buckets = list(ref["buckets"])
    body = [["bf16 (reference)", *[f"{ref['buckets'][b][0]:.3f}" for b in buckets]]]
    body += [[label(r), *[pct(r["buckets"][b][2]) for b in buckets]] for r in rows]
    caption = (f"Simulation in transformers (`eval/accuracy_sim.py --long`: K and V read as the "
               f"backend reads them), SmolLM2-135M, {data['device']}, {day(data['date'])}: bf16's "
               f"perplexity by the position of the predicted token, then each row's change against "
               f"it, over {ref['tokens']:,} tokens of kernel.jsonl joined into documents of "
               f"{data['max_len']:,} tokens")
    return rows, buckets, body, caption


@table("long-calibration-sim")
def long_calibration_sim() -> str:
    """Perplexity by position with codebooks calibrated on short and on long sequences, by
    simulation (accuracy_sim.py --long): where the error past 2K tokens comes from."""
    def label(r):
        c = r["method_params"]
        return (f"K{r['bits_k']}/V{r['bits_v']} bits W={r['window']}, calibrated on "
                + calibration_words(c["tokens"], c["seq_len"], c.get("pack")))
    rows, buckets, body, caption = sim_by_position("long_calibration_sim.json", label)
    trained = rows[0]["method_params"]
    return "\n".join([
        md(["codebooks", *[f"positions {b}" for b in buckets]], body), "",
        caption + f". Both sets were trained with the same settings "
        f"({trained['samples_per_head']:,} samples per head, "
        f"{trained['method']['niter']} k-means iterations) on the "
        f"same text. " + source("long_calibration_sim.json")])


@table("long-window-sim")
def long_window_sim() -> str:
    """Perplexity by position with one set of codebooks read through residual windows of
    several sizes, by simulation (accuracy_sim.py --long): what the window is worth at
    distance."""
    def label(r):
        return (f"K{r['bits_k']}/V{r['bits_v']} bits, W={r['window']}"
                + (" (every key and value through codes but BOS)" if r["window"] == 0 else ""))
    rows, buckets, body, caption = sim_by_position("long_window_sim.json", label)
    c = rows[0]["method_params"]
    return "\n".join([
        md(["residual window", *[f"positions {b}" for b in buckets]], body), "",
        caption + f"; one codebook file (sha256 {rows[0]['codebook_sha256']}) calibrated on "
        + calibration_words(c["tokens"], c["seq_len"], c.get("pack")) + ", every row from one run. "
        + source("long_window_sim.json")])


def exact_idea(r: dict, doc_tokens: int) -> tuple[str, str]:
    """What an ``accuracy_sim.py --exact`` row keeps exact, and its bits per element: the
    codes' bits, plus what the exact part would take (16-bit values; 8-bit element
    indices; a token set's cost spread over a document of ``doc_tokens``)."""
    bits = (r["bits_k"] + r["bits_v"]) / 2
    if not r.get("exact"):
        return "nothing more (the residual window and BOS)", f"{bits:g}"
    kind, amount = r["exact"].split(":")
    x = float(amount)
    head_dim = 8 * r["m_k"] // r["bits_k"]
    idea, extra = {
        "rows": (f"the {x:.0%} of keys and of values whose codes err most", 16 * x),
        "elems": (f"the {x:.0%} of K and V elements whose codes err most", 24 * x),
        "page": (f"in every 128-position page, the {x:g} key{'s' * (x > 1)} and the {x:g} "
                 f"value{'s' * (x > 1)} whose codes err most", 16 * x / 128),  # accuracy_sim.PAGE
        "vec": (f"the {x:g} element{'s' * (x > 1)} of each key and value whose codes err most",
                24 * x / head_dim),
        "mass": (f"the {x:g} keys and values per layer and KV head that draw the most "
                 "attention (chosen with hindsight)", 16 * x / doc_tokens),
        "first": (f"positions 1 to {x:g}", 16 * x / doc_tokens),
    }[kind]
    return idea, f"{bits + extra:.2f}"


def exact_rows(name: str) -> tuple[dict, list[dict]]:
    data = load(name)
    return data, [r for r in data["rows"] if r["method"] != "bf16"]


@table("exact-sim-long")
def exact_sim_long() -> str:
    """What keeping more of K and V exact would be worth at distance, by simulation
    (accuracy_sim.py --long --exact), every bit width."""
    files = ("long_exact_sim.json", "long_exact_sim_low_bits.json")
    body, meta, buckets = [], [], None
    for name in files:
        data, rs = exact_rows(name)
        meta.append(data)
        buckets = buckets or list(rs[0]["buckets"])
        for r in rs:
            idea, bits = exact_idea(r, data["max_len"])
            body.append([custom_name(r["bits_k"], r["bits_v"]).removeprefix("CUSTOM "), idea, bits,
                         *[pct(v[2]) for v in r["buckets"].values()], pct(r["delta_pct"])])
    ref = next(r for r in meta[0]["rows"] if r["method"] == "bf16")
    books = ", ".join(f"{custom_name(r['bits_k'], r['bits_v']).removeprefix('CUSTOM ')} "
                      f"{r['codebook_sha256']}" for d in meta for r in d["rows"]
                      if r.get("codebook_sha256") and not r.get("exact"))
    return "\n".join([
        md(["codes", "also read exactly", "bits per element", *[f"positions {b}" for b in buckets],
            "all"], body), "",
        f"Simulation in transformers (`eval/accuracy_sim.py --long --exact`: K and V read as the "
        f"backend reads them, then the named part exact), SmolLM2-135M, "
        f"{devices(meta)}, {day(meta[0]['date'])}: perplexity change against bf16 by the "
        f"position of the predicted token, over {ref['tokens']:,} tokens of kernel.jsonl joined "
        f"into documents of {meta[0]['max_len']:,} tokens; window 128; codebooks from "
        f"`calibrate`'s defaults (sha256 {books}), each read every way in one run. Bits per "
        f"element: the codes', plus 16 bits per exact value and 8 per element index; a set of "
        f"tokens is spread over the document. " + source(*files)])


def exact_short(name: str) -> str:
    """An accuracy_sim.py --exact run on documents cut short: one row per thing kept exact,
    one column per text domain."""
    data, rs = exact_rows(name)
    domains = list(dict.fromkeys(r["eval_text"] for r in rs))
    groups = {}
    for r in rs:
        groups.setdefault((r["method"], r.get("exact")), {})[r["eval_text"]] = r
    body = []
    for g in groups.values():
        r = g[domains[0]]
        idea, bits = exact_idea(r, data["max_len"])
        body.append([custom_name(r["bits_k"], r["bits_v"]).removeprefix("CUSTOM "), idea, bits,
                     " / ".join(f"{g[d]['delta_pct']:+.2f}" for d in domains)])
    return "\n".join([
        md(["codes", "also read exactly", "bits per element", " / ".join(domains)], body), "",
        sim_caption(data, rs[0], "--exact", f"one codebook file (sha256 {rs[0]['codebook_sha256']})",
                    ", read every way in one run.", name)])


def sim_caption(data: dict, r: dict, flag: str, books: str, tail: str, name: str) -> str:
    """The caption of a simulation at 2K tokens that reads codebook files: how it ran, and
    how ``books`` were calibrated (from row ``r``)."""
    c = r["method_params"]
    return (f"Simulation in transformers (`eval/accuracy_sim.py {flag}`), SmolLM2-135M in "
            f"{data['dtype'] if 'dtype' in data else 'bfloat16 (the default)'}, {data['device']}, "
            f"{day(data['date'])}: perplexity change against the same model unquantized in %, "
            f"{data['docs_per_domain']} documents per domain cut at {data['max_len']:,} tokens; "
            f"window 128; {books} calibrated on "
            + calibration_words(c["tokens"], c["seq_len"], c.get("pack")) + tail + " " + source(name))


@table("v-allocation-costs")
def v_allocation_costs() -> str:
    """Each layer's V cost by bits as calibrate --bits-v-mean measured it, and the bits
    it chose, for each file of the simulation run over them, with their simulated change."""
    data, rs = exact_rows("v_allocation_sim.json")
    files = {}
    for r in rs:
        files.setdefault(r["codebook_sha256"], r)
    runs_ = sorted(files.values(), key=lambda r: r["method_params"]["bits_v_mean"])
    costs = runs_[0]["method_params"]["v_cost"]
    widths = sorted(costs[0], key=float)
    total = sum(layer["2"] for layer in costs)
    body = []
    for i, layer in enumerate(costs):
        chosen = []
        for r in runs_:
            d = 8 * r["m_k"] // r["bits_k"]
            chosen.append(f"{8 * r['m_v'][i] // d}")
        body.append([i, *(f"{100 * layer[w] / total:.2f}" for w in widths), *chosen])
    same = all(r["method_params"]["v_cost"] == costs for r in runs_)
    sims = "; ".join(f"--bits-v-mean {r['method_params']['bits_v_mean']:g} "
                     f"({(r['bits_k'] + r['bits_v']) / 2:g} bits per element) "
                     f"{r['delta_pct']:+.2f}% on {r['eval_text']} text" for r in runs_)
    return "\n".join([
        md(["layer", *(f"cost of V at {w} bit{'s' if w != '1' else ''}" for w in widths),
            *(f"V bits, --bits-v-mean {r['method_params']['bits_v_mean']:g}" for r in runs_)], body), "",
        "Each layer's cost: the sum over its sampled rows of (g . e)^2, g the row's gradient of "
        "the loss through reads as codes, e its coding error, in % of the sum over every layer "
        "at 2 bits" + ("" if same else " (of the first file; the files' costs differ)")
        + f"; calibrate's defaults on {runs_[0]['method_params']['tokens']:,} tokens in "
        f"{runs_[0]['method_params']['seq_len']:,}-token sequences. In simulation "
        f"(`eval/accuracy_sim.py`, {data['device']}, {day(data['date'])}, "
        f"{data['docs_per_domain']} documents): {sims}. " + source("v_allocation_sim.json")])


def pairs_by_layer(layers: list) -> str:
    """Each layer's (K, V) bits, grouped: 'K4/V2 in 8, 14; K2/V2 in 0-7'."""
    pairs = sorted({tuple(x) for x in layers}, key=lambda x: (-x[0], -x[1]))
    return "; ".join(f"K{k:g}/V{v:g} in " + layer_ranges([i for i, x in enumerate(layers) if tuple(x) == (k, v)])
                     for k, v in pairs)


@table("kv-allocation-sim")
def kv_allocation_sim() -> str:
    """K and V bits by layer chosen by cost (accuracy_sim.py --allocate), beside the
    uniform files they are read through, one run."""
    data, rs = exact_rows("kv_allocation_sim.json")
    body = []
    for r in sorted(rs, key=lambda r: ((r["bits_k"] + r["bits_v"]) / 2, "allocate" in r["method"])):
        bits = (r["bits_k"] + r["bits_v"]) / 2
        if r["method"].startswith("allocate:"):
            what = pairs_by_layer(r["method_params"]["layers"])
            name = f"chosen for a mean of {r['method_params']['allocate']:g} bits"
        else:
            name, what = custom_name(r["bits_k"], r["bits_v"]).removeprefix("CUSTOM "), "every layer"
        body.append([name, what, f"{bits:.2f}".rstrip("0").rstrip("."), f"{r['delta_pct']:+.2f}"])
    files = sorted({r["codebook_sha256"] for r in rs if "codebook_sha256" in r})
    return "\n".join([
        md(["K and V", "layers", "bits per element", rs[0]["eval_text"]], body), "",
        f"Simulation in transformers (`eval/accuracy_sim.py --allocate`), SmolLM2-135M in "
        f"{data['dtype']}, {data['device']}, {day(data['date'])}: perplexity change against the "
        f"same model unquantized in %, {data['docs_per_domain']} documents cut at "
        f"{data['max_len']:,} tokens; window 128; each layer's K and V read through the codebook "
        f"file of their bits (sha256 {', '.join(files)}, calibrated alike on 2K-token sequences), "
        f"the costs from a capture of {data['calib_tokens']:,} tokens of the same text. "
        + source("kv_allocation_sim.json")])


@table("fisher-sim")
def fisher_sim() -> str:
    """k-means weighted by Fisher information against the default, in simulation."""
    body = []
    for file in ("fisher_sim.json", "fisher_sim_2bits.json"):
        data = load(file)
        groups = {}
        for r in data["rows"]:
            if r["method"] != "bf16":
                groups.setdefault(r["method"], {})[r["eval_text"]] = r
        for g in groups.values():
            r = next(iter(g.values()))
            p = r["method_params"]
            what = ("calibrate's default" if not (p["k_fisher"] or p["v_fisher"]) else
                    fisher_words({"method": json.dumps(p)}).removeprefix(", "))
            body.append([custom_name(r["bits_k"], r["bits_v"]).removeprefix("CUSTOM "), what,
                         " / ".join(f"{g[d]['delta_pct']:+.2f}" for d in DOMAINS if d in g)])
    return "\n".join([
        md(["codes", "training", " / ".join(DOMAINS)], body), "",
        f"Perplexity change against bf16 in %; simulation in transformers, SmolLM2-135M in "
        f"bfloat16, {data['device']}, {day(data['date'])}, {data['docs_per_domain']} documents "
        f"per domain cut at {data['max_len']:,} tokens; every configuration trained from one "
        f"capture of {data['calib_tokens']:,} tokens (2K-token sequences) per run. "
        + source("fisher_sim.json", "fisher_sim_2bits.json")])


@table("layer-bits-sim")
def layer_bits_sim() -> str:
    return v_layers_sim_table("layer_bits_sim.json")


@table("layer-groups-sim")
def layer_groups_sim() -> str:
    return v_layers_sim_table("layer_groups_sim.json")


def v_layers_sim_table(file: str) -> str:
    """Some layers' V at other bits than the others' (accuracy_sim.py --v-from), beside the
    files' own bit widths, one run."""
    data, rs = exact_rows(file)
    domains = list(dict.fromkeys(r["eval_text"] for r in rs))
    groups = {}
    for r in rs:
        groups.setdefault((r["method"], json.dumps(r.get("v_from"))), {})[r["eval_text"]] = r
    n_layers = len(rs[0]["method_params"]["rel_mse_k"])
    body = []
    for g in sorted(groups.values(), key=lambda g: next(iter(g.values()))["bits_v"]):
        r = g[domains[0]]
        d = 8 * r["m_k"] // r["bits_k"]
        mvs = r["m_v"] if isinstance(r["m_v"], list) else [r["m_v"]] * n_layers
        base = codebook_m_v(r) if r.get("v_from") else max(set(mvs), key=mvs.count)
        parts = [f"{8 * m // d} in layers " + layer_ranges([i for i, x in enumerate(mvs) if x == m])
                 for m in sorted({m for m in mvs if m != base}, reverse=True)]
        if base is not None:
            parts.append(f"{8 * base // d} in {'the other layers' if parts else 'every layer'}")
        bits = (r["bits_k"] + r["bits_v"]) / 2
        body.append([r["bits_k"], ", ".join(parts), f"{bits:.2f}".rstrip("0").rstrip("."),
                     " / ".join(f"{g[d_]['delta_pct']:+.2f}" for d_ in domains)])
    books = {r["codebook_sha256"] for r in rs} | {v["codebook_sha256"] for r in rs for v in r.get("v_from") or []}
    four = any(r["bits_k"] == r["bits_v"] == 4 and not r.get("v_from") for r in rs)
    return "\n".join([
        md(["bits of K", "bits of V", "bits per element", " / ".join(domains)], body), "",
        sim_caption(data, rs[0], "--v-from", f"codebook files (sha256 {', '.join(sorted(books))})",
                    "; each layer's V read through the file of its bits, K through the K4/V2 file"
                    + (" or, in the 4-bit row, the 4-bit file" if four else "")
                    + f" ({n_layers} layers).", file)])


def codebook_m_v(r: dict) -> int:
    """The V subspaces of a mixed row's own codebook file: those of the layers no donor
    file gave (None where donors gave every layer)."""
    given = {i for v in r["v_from"] for i in v["layers"]}
    return next((m for i, m in enumerate(r["m_v"]) if i not in given), None)


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(runs)


@table("exact-sim")
def exact_sim() -> str:
    """What more exact K and V would be worth at 2K tokens on the three domains."""
    return exact_short("exact_sim.json")


@table("exact-sim-layouts")
def exact_sim_layouts() -> str:
    """The same stores in layouts a kernel could read, against the ideal ones, one run."""
    return exact_short("exact_sim_layouts.json")


@table("long-context-fidelity")
def long_context_fidelity() -> str:
    return fidelity_table("long_context.json")


@table("long-bits-fidelity")
def long_bits_fidelity() -> str:
    return fidelity_table("long_bits_by_layer.json")


@table("long-gemma-calibration-fidelity")
def long_gemma_calibration_fidelity() -> str:
    return fidelity_table("long_gemma_calibration.json")


@table("long-exact-fidelity")
def long_exact_fidelity() -> str:
    return fidelity_table("long_exact.json")


def fidelity_table(file: str) -> str:
    """Per model: bf16's perplexity per position bucket, the others' change and top-1."""
    out = []
    for model, sec in long_models(file).items():
        buckets = [r["bucket"] for r in sec["fidelity"]["rows"] if r["engine"] == LONG_REF]
        body = []
        for e in sec["engines"]:
            if "error" in e:
                continue
            row = [cache_name(e)]
            for b in buckets:
                r = fidelity(sec, e, b)
                row.append("" if r is None else f"{r['ppl']:.3f}" if "delta_pct" not in r
                           else f"{pct(r['delta_pct'])}, {100 * r['top1_agreement']:.1f}%")
            body.append(row)
        out += [f"**{model}**", "", md(["KV cache"] + buckets, body), "", long_note(sec, model), ""]
    return "\n".join(out + ["bf16's perplexity per position bucket, then each cache's change "
                            "against it and its top-1 agreement with bf16. " + source(file)])


# --- the headline ----------------------------------------------------------------------


@table("headline")
def headline() -> str:
    acc = load("accuracy.json")
    e2e_rows = load("e2e_throughput.json")["rows"]

    used = set()

    def decode(backend: str, context: int) -> str:
        mine = [r for r in e2e_rows if r["backend"] == backend and r["context"] == context]
        if not mine:
            return "not measured"
        r = max(mine, key=lambda r: r["date"])
        used.add(r["git_commit"])
        return ratio(r["decode_tok_s"] / same_run(e2e_rows, r, "FLASH_ATTN", context=context)["decode_tok_s"])

    bf16_tokens = next(r for r in acc["rows"] if r["label"].startswith("FLASH_ATTN"))["kv_cache_tokens"]
    body = []
    for name, rs in quality_configs(acc["rows"]):
        r0 = rs[0]
        by = {r["eval_text"]: r for r in rs}
        if r0.get("bits_k") in (None, 16):
            if name.startswith("FLASH_ATTN"):
                label, bits, e2e_name = "bf16 (FLASH_ATTN)", "16", "FLASH_ATTN"
            else:
                label, bits, e2e_name = name, f"{16 * r0['bytes_per_token_vs_bf16']:.1f}".removesuffix(".0"), name
        elif is_default(r0) and not calibration(r0):  # other calibrations: docs/results.md
            e2e_name = custom_name(r0["bits_k"], r0["bits_v"])
            label = e2e_name
            bits = str(r0["bits_k"]) if r0["bits_k"] == r0["bits_v"] else f"{r0['bits_k']} / {r0['bits_v']}"
        else:
            continue
        base = label.startswith("bf16")
        quality = "0 (reference)" if base else " / ".join(pct(by[d]["delta_pct"]) for d in DOMAINS)
        body.append([label, bits, ratio(r0["kv_cache_tokens"] / bf16_tokens, 1),
                     quality, f"{100 * r0['greedy_agreement_vs_bf16']:.0f}%",
                     decode(e2e_name, 1024), decode(e2e_name, 32768)])
    return "\n".join([
        md(["KV cache", "bits per element", "KV capacity", "perplexity vs bf16: kernel / fortunes / python",
            "greedy = bf16", "decode vs bf16, 1K context", "decode vs bf16, 32K"], body), "",
        f"Quality and capacity: {acc['rows'][0]['model']} in vLLM on held-out text of three kinds, "
        f"{acc['device']} (`eval/results/accuracy.json`); the baselines' bits per element follow "
        "from the capacity vLLM gives them. Decode: `LLM.generate` tokens/s on "
        f"Llama-3-8B's shape at the largest batch each cache holds, {devices(e2e_rows)}, each "
        f"against FLASH_ATTN in the same run ({len(used)} runs, dated in docs/results.md; "
        "`eval/results/e2e_throughput.json`)."])


# --- documents -------------------------------------------------------------------------


def render(text: str, path: str) -> str:
    """``text`` with every marked table regenerated."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        out.append(lines[i])
        m = BEGIN.match(lines[i])
        i += 1
        if not m:
            continue
        if m.group(1) not in TABLES:
            raise SystemExit(f"report.py: {path}: no table named {m.group(1)!r} (known: {', '.join(TABLES)})")
        end = next((j for j in range(i, len(lines)) if lines[j] == END), None)
        if end is None:
            raise SystemExit(f"report.py: {path}: table {m.group(1)!r} has no {END} line")
        out += TABLES[m.group(1)]().split("\n") + [END]
        i = end + 1
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 where a document's tables differ from the results")
    a = p.parse_args()
    stale = 0
    for doc in DOCUMENTS:
        path = ROOT / doc
        old = path.read_text()
        new = render(old, doc)
        if new == old:
            continue
        if a.check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       doc, doc + " (from eval/results)"))
        else:
            path.write_text(new)
            print(f"report.py: rewrote the tables of {doc}")
    if stale:
        print(f"report.py: {stale} document(s) out of date with eval/results: run python eval/report.py",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
