"""eval/parallel.py off the GPU: each engine's process reads every setting the run was
given (its options go through the same parser), layouts are checked when read, DP ranks'
shares merge into one run's perplexity, and greedy agreement counts what differs."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import parallel  # noqa: E402

# every option of the run, none at its default
OPTIONS = {"--model": ["/models/gemma3"], "--model-name": ["Gemma-3-270M"],
           "--codebooks": ["/models/gemma3/pq/b4.safetensors"],
           "--layouts": ["tp2", "pp2", "dp4"],
           "--backends": ["CUSTOM"], "--eval": ["kernel=/t/kernel.jsonl", "python=/t/heldout.jsonl"],
           "--max-len": ["1024"], "--docs": ["7"], "--prompts": ["5"], "--prompt-len": ["99"],
           "--gen-tokens": ["17"], "--gpu-memory-utilization": ["0.25"], "--work": ["/w"],
           "--out": ["/o.json"]}


def argv(**changes) -> list[str]:
    """The run's options, with ``changes`` (``layouts=["tp2"]``; None drops the option)."""
    opts = dict(OPTIONS, **{"--" + k.replace("_", "-"): v for k, v in changes.items()})
    return [a for o, v in opts.items() if v is not None for a in (o, *v)]


RUN = argv()
ENGINE = dict(one=True, backend="CUSTOM", layout="dp4", rank=3, json="/w/x.json.3")


def test_every_option_of_the_run_is_set_here():
    given = set(OPTIONS)
    options = {o for a in parallel.parser()._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"}
    engine = {"--" + k for k in ENGINE}
    assert options - engine == given, "set every new option in RUN, off its default"


def test_child_argv_round_trips_every_setting():
    p = parallel.parser()
    args = p.parse_args(RUN)
    assert all(getattr(args, a.dest) != a.default for a in p._actions
               if a.option_strings and a.dest not in ENGINE and a.dest != "help")
    child = p.parse_args(parallel.child_argv(args, "CUSTOM", "dp4", "/w/x.json.3", 3))
    assert vars(child) == {**vars(args), **ENGINE}
    assert child.model_name == "Gemma-3-270M" and child.eval == ["kernel=/t/kernel.jsonl",
                                                                 "python=/t/heldout.jsonl"]


def test_child_argv_without_codebooks_parses():
    p = parallel.parser()
    args = p.parse_args(argv(codebooks=None))
    assert args.codebooks is None
    child = p.parse_args(parallel.child_argv(args, "FLASH_ATTN", "one", "/w/y.json.0"))
    assert vars(child) == {**vars(args), **dict(ENGINE, backend="FLASH_ATTN", layout="one",
                                                rank=0, json="/w/y.json.0")}


@pytest.mark.parametrize("layout, sizes", [("one", (1, 1, 1)), ("tp2", (2, 1, 1)),
                                           ("pp2", (1, 2, 1)), ("dp2", (1, 1, 2)),
                                           ("tp4", (4, 1, 1)), ("dp12", (1, 1, 12))])
def test_layout_sizes(layout, sizes):
    assert parallel.layout_sizes(layout) == sizes


@pytest.mark.parametrize("bad", ["xx2", "tp", "tp0", "tp-2", "TP2", "tp2x", "two", ""])
def test_a_bad_layout_is_one_argparse_error_naming_the_forms(bad, capsys):
    with pytest.raises(ValueError, match="expected one, tpK, ppK or dpK"):
        parallel.layout_sizes(bad)
    with pytest.raises(SystemExit) as e:
        parallel.parser().parse_args(argv(layouts=["tp2", bad]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f": error: argument --layouts: layout {bad!r}: expected one, "
                        "tpK, ppK or dpK with K >= 1 (e.g. tp2)"), err


def test_layouts_beyond_the_visible_gpus_are_refused_at_start(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 2)
    monkeypatch.setattr(parallel, "run", lambda *a: pytest.fail("an engine was started"))
    with pytest.raises(SystemExit) as e:
        parallel.main(argv(layouts=["tp2", "tp4", "dp2"]))
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        ": error: --layouts tp2 tp4 dp2 need 4 GPUs, 2 visible "
        "(CUDA_VISIBLE_DEVICES): drop the larger layouts or run on more GPUs")


def test_a_failed_engine_is_recorded_and_the_run_goes_on(monkeypatch, capsys, tmp_path):
    """A layout whose process fails is recorded with its output and the next one runs; a
    backend whose one-GPU run fails skips its layouts."""
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 2)
    monkeypatch.setattr(parallel, "provenance", lambda: {})
    monkeypatch.setattr(parallel, "codebook_meta", lambda path: {})
    same = dict(ppl={"kernel": (2.0, 4)}, greedy={"0": [1, 2]})
    outcomes = {("FLASH_ATTN", "one"): dict(error="no GPU"),
                ("CUSTOM", "one"): same, ("CUSTOM", "tp2"): dict(error="Traceback: boom"),
                ("CUSTOM", "pp2"): same}
    started = []

    def run(args, backend, layout, path):
        started.append((backend, layout))
        return outcomes[backend, layout]

    monkeypatch.setattr(parallel, "run", run)
    out = tmp_path / "parallel.json"
    assert parallel.main(argv(layouts=["tp2", "pp2"], backends=["FLASH_ATTN", "CUSTOM"],
                              eval=["kernel=k.jsonl"], work=[str(tmp_path)],
                              out=[str(out)])) == 0
    assert started == [("FLASH_ATTN", "one"), ("CUSTOM", "one"), ("CUSTOM", "tp2"),
                       ("CUSTOM", "pp2")]
    assert "Traceback: boom" in capsys.readouterr().out
    rows = parallel.json.load(open(out))["models"]["Gemma-3-270M"]["rows"]
    assert [(r["backend"], r["layout"], r.get("error")) for r in rows] == [
        ("FLASH_ATTN", "one", "no GPU"), ("CUSTOM", "tp2", "Traceback: boom"),
        ("CUSTOM", "pp2", None)]
    assert rows[2]["identical_sequences"] == "1/1" and rows[2]["delta_pct_kernel"] == 0


def test_merged_dp_shares_give_the_perplexity_of_all_tokens():
    a = dict(ppl={"kernel": [120.0, 50], "python": [30.0, 20]}, greedy={"0": [5, 6], "2": [7]})
    b = dict(ppl={"kernel": [100.0, 30], "python": [70.0, 80]}, greedy={"1": [8, 9], "3": [1]})
    merged = parallel.merge([a, b])
    assert merged["ppl"] == {"kernel": (220.0, 80), "python": (100.0, 100)}
    assert merged["greedy"] == {"0": [5, 6], "1": [8, 9], "2": [7], "3": [1]}
    one = dict(ppl={"kernel": [220.0, 80], "python": [90.0, 100]},
               greedy={"0": [5, 6], "1": [8, 0], "2": [7], "3": [1]})
    row = parallel.compare(one, merged)
    assert row["ppl_kernel"] == round(math.exp(220.0 / 80), 4) and row["delta_pct_kernel"] == 0
    assert row["ppl_python"] == round(math.exp(1.0), 4)
    assert row["ppl_one_python"] == round(math.exp(0.9), 4)
    assert row["delta_pct_python"] == round(100 * (math.exp(0.1) - 1), 4)


def test_a_prompt_from_two_ranks_is_refused():
    part = dict(ppl={}, greedy={"0": [1]})
    with pytest.raises(ValueError, match=r"prompts \['0'\] were generated by two DP ranks"):
        parallel.merge([part, part])


def test_scored_token_counts_must_agree():
    with pytest.raises(ValueError, match="kernel: 9 tokens scored, 10 on one GPU"):
        parallel.compare(dict(ppl={"kernel": [1.0, 10]}, greedy={"0": [1]}),
                         dict(ppl={"kernel": [1.0, 9]}, greedy={"0": [1]}))


def test_agreement():
    a = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8], "10": [1, 1, 1, 1], "2": [9, 9, 9, 9]}
    b = {"0": [1, 2, 3, 4], "1": [5, 0, 7, 8], "10": [1, 1, 1, 2], "2": [0, 9, 9, 9]}
    assert parallel.agreement(a, b) == dict(identical_sequences="1/4",
                                            identical_tokens=round(13 / 16, 4),
                                            mean_tokens_before_first_difference=2.0)
    assert parallel.agreement(a, a) == dict(identical_sequences="4/4", identical_tokens=1.0,
                                            mean_tokens_before_first_difference=4.0)
