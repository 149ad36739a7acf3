"""The calibration command takes any input and says what is wrong in one line (exit status
2, no traceback, no usage), and reads its text only as far as the tokens asked for need."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers import write_model_config
from test_calibrate import tiny_model
from vllm_pq_backend import calibrate
from vllm_pq_backend.calibrate import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("cli") / "model")


class WordTokenizer:
    """One id per distinct word, in order of first sight (id 0 is BOS)."""

    bos_token_id = 0

    def __init__(self):
        self.words = ["<s>"]
        self.ids = {}

    def __call__(self, text, add_special_tokens=False):
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
        return {"input_ids": [self.ids[w] for w in text.split()]}


@pytest.fixture
def tok():
    return WordTokenizer()


GOOD = "the lazy dog jumps over the quick brown fox " * 40


def one_line_error(capsys, args) -> str:
    """main(args)'s exit status must be 2 and its stderr one 'calibrate: error:' line."""
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("calibrate: error: "), err
    return err[0]


def cli(model, text, *more):
    return ["--model", model, "--text", *map(str, text if isinstance(text, list) else [text]),
            "--device", "cpu", "--dtype", "float32", "--m", "8", "--tokens", "600",
            "--samples", "300", "--seq-len", "128", "--niter", "1", *more]


def test_jsonl_lines_without_text_are_named(tmp_path, model, capsys):
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"text": "short"}) + "\n\n" + json.dumps({"title": GOOD}) + "\n")
    err = one_line_error(capsys, cli(model, f))
    assert f'{f}, line 3: no "text" string' in err
    f.write_text(json.dumps({"text": 7}) + "\n")
    assert f'{f}, line 1: no "text" string' in one_line_error(capsys, cli(model, f))
    f.write_text('{"text": "unterminated\n')
    assert f"{f}, line 1: not JSON: Unterminated string" in one_line_error(capsys, cli(model, f))
    f.write_bytes(b'{"text": "caf\xe9"}\n')
    assert f"{f}, line 1: not UTF-8 text (invalid byte at column 14)" in one_line_error(
        capsys, cli(model, f))


def test_invalid_utf8_is_refused_with_its_offset(tmp_path, model, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes(GOOD.encode() + "café".encode("latin-1"))
    err = one_line_error(capsys, cli(model, f))
    assert f"{f}: not UTF-8 text (invalid byte at offset {len(GOOD) + 3})" in err


def test_utf8_offsets_are_exact_across_blocks(tmp_path, monkeypatch):
    """Text is decoded block by block; a character cut by a block boundary is kept whole,
    and an invalid byte's offset counts from the start of the file."""
    monkeypatch.setattr(calibrate, "_BLOCK", 4)
    f = tmp_path / "a.txt"
    text = "ab\nçé€\nxyz"
    f.write_text(text)
    assert "".join(calibrate._text_pieces(f)) == text
    f.write_bytes(text.encode() + b"\n\xff\xfe")
    with pytest.raises(calibrate.CalibrationError, match=f"offset {len(text.encode()) + 1}"):
        "".join(calibrate._text_pieces(f))
    f.write_bytes(text.encode() + "€".encode()[:2])  # cut short at the end
    with pytest.raises(calibrate.CalibrationError, match=f"offset {len(text.encode())}\\)"):
        "".join(calibrate._text_pieces(f))


def test_a_folder_named_like_a_text_file_is_searched_not_read(tmp_path, model, capsys):
    docs = tmp_path / "docs"
    (docs / "notes.md").mkdir(parents=True)
    (docs / "notes.md" / "a.txt").write_text("the lazy dog")
    assert calibrate.Documents([str(docs)]).files == [docs / "notes.md" / "a.txt"]
    for where in (docs, docs / "notes.md"):  # the walk meets it, or it is given by name
        err = one_line_error(capsys, cli(model, where))
        assert "has the 15 tokens a sequence needs (the longest has 3)" in err


def test_documents_too_short_and_no_text(tmp_path, model, capsys):
    (tmp_path / "a.txt").write_text("the lazy dog")
    (tmp_path / "b.txt").write_text("the quick brown fox jumps")
    err = one_line_error(capsys, cli(model, tmp_path, "--no-pack"))
    assert (f"no document in {tmp_path} has the 15 tokens a sequence needs (the longest has 5)"
            in err)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.md").write_text("\n  \n")
    assert f"no text found in {empty}" in one_line_error(capsys, cli(model, empty))


@pytest.mark.parametrize("flags,want", [
    (["--seq-len", "1"], "--seq-len must be at least 16"),
    (["--tokens", "100"], "--tokens must be at least 256"),
    (["--samples", "10"], "--samples must be at least 256"),
    (["--bits", "3"], "argument --bits/--bits-k: invalid choice: 3 (choose from 1, 2, 4)"),
    (["--bits-v", "8"], "argument --bits-v: invalid choice: 8 (choose from 1, 2, 4)"),
    (["--method", "k_gamma=high"], "--method k_gamma=high: k_gamma takes a float"),
    (["--device", "gpu0"], "--device gpu0: not a device; give cuda, cuda:N or cpu"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments(tmp_path, model, capsys, flags, want):
    (tmp_path / "a.txt").write_text(GOOD)
    assert want in one_line_error(capsys, cli(model, tmp_path / "a.txt", *flags))


def test_a_gpu_that_is_not_there(tmp_path, model, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text(GOOD)
    args = cli(model, tmp_path / "a.txt")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    err = one_line_error(capsys, args + ["--device", "cuda"])
    assert "--device cuda: torch" in err and "sees no CUDA GPU" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = one_line_error(capsys, args + ["--device", "cuda:2"])
    assert "--device cuda:2: torch sees 2 CUDA GPU(s), cuda:0 to cuda:1" in err


def test_a_model_folder_transformers_cannot_load(tmp_path, capsys):
    m = write_model_config(str(tmp_path / "m"), head_dim=32)  # config.json, no tokenizer
    (tmp_path / "a.txt").write_text(GOOD)
    err = one_line_error(capsys, cli(m, tmp_path / "a.txt"))
    assert f"--model {m}: cannot load its tokenizer with transformers" in err


def test_help_documents_the_device():
    text = calibrate.build_parser().format_help()
    assert "--device" in text and "cuda:N" in text and "40 minutes on a CPU" in text


def test_the_cpu_warning_estimates_from_parameters_and_tokens(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = calibrate.cpu_warning(135_000_000, 65536)
    assert line.startswith("calibrate: warning: running on the CPU: about 40 minutes for 135M "
                           "parameters x 65536 tokens")
    assert line.endswith("give --device cuda (or cuda:N) to run on a GPU (torch sees none here)")
    assert "about 10 minutes" in calibrate.cpu_warning(135_000_000, 16384)
    assert "about 39.5 hours for 8.0B parameters" in calibrate.cpu_warning(8 * 10**9, 65536)
    assert "under a minute for 0.16M parameters" in calibrate.cpu_warning(161_000, 1000)
    # --bits-v-mean adds the loss's backward pass: about four times as long
    assert ("about 2.7 hours for 135M parameters x 65536 tokens, forward and backward"
            in calibrate.cpu_warning(135_000_000, 65536, backward=True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert calibrate.cpu_warning(135_000_000, 65536).endswith("to run on a GPU")


def test_jsonl_is_read_only_as_far_as_the_tokens_need(tmp_path, tok):
    f = tmp_path / "big.jsonl"
    with open(f, "w") as fh:
        for _ in range(200):
            fh.write(json.dumps({"text": GOOD}) + "\n")
        fh.write("this line is not JSON, and is never read\n")
    docs = calibrate.read_documents([str(f)])
    seqs = calibrate.token_sequences(tok, docs, 128, 1000)
    assert sum(map(len, seqs)) <= 1000 and docs.count < 10
    with pytest.raises(calibrate.CalibrationError, match="line 201: not JSON"):
        calibrate.token_sequences(tok, calibrate.read_documents([str(f)]), 128, 10**9)


def test_a_pipe_without_end_is_read_only_as_far_as_the_tokens_need(tmp_path, tok):
    """--text <(zcat corpus.gz): an endless stream, of which calibration reads what the
    tokens asked for need (a few of the 1 MiB blocks), then stops."""
    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    written = []

    def writer():
        line = (GOOD + "\n").encode()
        try:
            with open(fifo, "wb") as fh:
                while sum(written) < 1 << 30:  # 1 GiB: the reader is long gone by then
                    fh.write(line * 1000)
                    written.append(len(line) * 1000)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    docs = calibrate.read_documents([str(fifo)])
    seqs = calibrate.token_sequences(tok, docs, 2048, 20000)
    del docs, seqs  # closes the read end
    import gc

    gc.collect()
    t.join(timeout=60)
    assert not t.is_alive() and sum(written) < 64 << 20, sum(written)


def test_shuffled_documents_come_from_every_file(tmp_path, tok):
    """--shuffle-docs samples the documents of all the files (by index, then seeking), in
    an order fixed by the seed."""
    for name in ("a", "b"):
        with open(tmp_path / f"{name}.jsonl", "w") as fh:
            for i in range(50):
                fh.write(json.dumps({"text": f"{name}{i} " + GOOD}) + "\n")
    (tmp_path / "c.txt").write_text("c0 " + GOOD)

    def firsts(seed):
        docs = calibrate.read_documents([str(tmp_path)])
        seqs = calibrate.token_sequences(tok, docs, 4096, 4000, shuffle_seed=seed)
        assert docs.count == len(seqs)
        return [tok.words[s[1]] for s in seqs]

    got = firsts(0)
    assert got == firsts(0) and got != firsts(1)
    assert len(got) == 12 and {g[0] for g in got} >= {"a", "b"}  # 11 x 362 tokens, + 18
    assert got != sorted(got) and len(set(got)) == len(got)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(calibrate.CalibrationError, match="needs files: .*pipe is not a regular"):
        calibrate.token_sequences(tok, calibrate.read_documents([str(fifo)]), 128, 1000,
                                  shuffle_seed=0)


def test_the_command_line_has_no_traceback(tmp_path, model):
    """As a user runs it: one line on stderr, exit status 2."""
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"body": GOOD}) + "\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for args in (cli(model, f), cli(model, f, "--bits", "3")):
        r = subprocess.run([sys.executable, "-m", "vllm_pq_backend.calibrate", *args],
                           capture_output=True, text=True, env=env, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("calibrate: error: ") and "Traceback" not in r.stderr


def test_packed_sequences_are_full_length_across_short_documents(tmp_path, tok):
    """--pack joins documents before the cut: every sequence but the last has --seq-len
    tokens though each document is far shorter, and the text is the documents' in order;
    without it each short document is a sequence of its own."""
    with open(tmp_path / "a.jsonl", "w") as fh:
        for i in range(40):
            fh.write(json.dumps({"text": f"doc{i} " + GOOD}) + "\n")
    docs = calibrate.read_documents([str(tmp_path / "a.jsonl")])
    alone = calibrate.token_sequences(tok, docs, 1024, 6000)
    assert max(map(len, alone)) < 1024 and len(alone) > 6
    docs = calibrate.read_documents([str(tmp_path / "a.jsonl")])
    packed = calibrate.token_sequences(tok, docs, 1024, 6000, pack=True)
    assert [len(s) for s in packed[:-1]] == [1024] * (len(packed) - 1)
    assert sum(map(len, packed)) == 6000 or len(packed[-1]) < 1024
    first_words = [tok.words[t] for s in packed for t in s[1:] if tok.words[t].startswith("doc")]
    assert first_words == [f"doc{i}" for i in range(len(first_words))] and len(first_words) > 6
