"""Train PQ codebooks for a model from local calibration text.

    python -m vllm_pq_backend.calibrate --model MODEL_DIR --text DOCS_DIR_OR_FILES \
        [--bits 4] [--bits-v 2] [--bits-v-mean 2 | --bits-mean 3]

Runs the model (transformers, offline) over the text and records, per layer and KV head,
K and V exactly as attention sees them, and how attention uses them: the query second
moment (weighted by each query's attention to keys it would read through codes) and the
attention mass each token receives from such queries. Then per (layer, KV head):

* K is trained for the error of the attention *scores*, not of k. A key error e costs
  (q.e)^2, whose mean over queries is e^T A e with A = E[q q^T]. So keys are mapped
  k' = k T with T = A^(gamma/2) (gamma = 1 makes L2 in k' exactly that score error;
  smaller gamma compresses A's eigenvalues, which keeps a few dominant query directions
  from starving the rest), then rotated onto the principal axes of k' with the axes
  dealt to subspaces so that their variance products balance (OPQ's eigenvalue
  allocation): every subspace's 256 centroids get an equal share of the work. The
  backend applies T to keys and T^-T to queries (q'.k' = q.k), so the store's plain
  nearest-centroid search is the weighted one, and nothing in the kernels changes.
* V is weighted by attention mass: a token's value error reaches the output in
  proportion to the attention it gets, so k-means counts each token with weight
  mass^alpha. V gets the same principal-axis rotation (the backend rotates V before
  the store and the attention output back); at 2 bits and fewer it is first mapped by
  the o_proj metric G^(1/4) (G = W_o^T W_o of the head's output columns: what a value
  error costs after the output projection).
* ``--fit-k measured`` does not assume one training of K for every layer: each layer's K
  is trained the ways of ``K_FITS`` (query metric exponent, attention-mass weights) and
  the one whose codes change the model's next-token distribution least is kept (KL in
  float32 on calibration sequences, half of them ending in a span copied from far back).
* The first token (BOS, an attention sink) is pinned: exact in every codebook.
* Learned sink logits (gpt-oss) join every softmax as the model computes them. They are
  weights, not cached, so nothing of them is coded.
* Code ``NAN_CODE`` of subspace 0, the serving's marker of non-finite K/V, is reserved:
  that subspace trains 255 centroids, and the sink is never pinned to the marker.

k-means runs on the GPU when there is one (vllm_pq_backend/kmeans.py), all subspaces of
a layer at once. The file lands next to the model, where the backend looks by default.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import sys
import time
import dataclasses
from array import array
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .codebooks import (base_m, codebook_path_hint, describe_layers_m, describe_m,
                        head_dim_of, reserve_nan_code, save_codebooks, supported_m_text)
from .config import (DEFAULT_BLOCK_SIZE, default_codebook_path, default_window, layer_runs,
                     layers_of_m, parse_layers)
from .kmeans import kmeans
from .layout import (BIT_RATES, NAN_CODE, NUM_CENTROIDS, bits_of, subspaces, supported_m,
                     window_start)

TEXT_SUFFIXES = (".txt", ".rst", ".md", ".jsonl")  # what folders are searched for
MIN_TOKENS = 16  # a shorter sequence (BOS included) is skipped: too little context
DEFAULT_SEQ_LEN = 2048  # tokens per forward pass when the model's config names no context
_BLOCK = 1 << 20  # bytes of a plain-text file decoded at a time


class CalibrationError(ValueError):
    """A bad input, reported as one line by main()."""


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror}") from None


def _text_pieces(path: Path):
    """A plain-text file's text in pieces of about ``_BLOCK`` bytes, cut after a newline:
    only as much of it is read as is consumed."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, offset = "", 0

    def decode(block: bytes) -> str:
        held = len(decoder.getstate()[0])  # bytes of a character the last block cut
        try:
            return decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise CalibrationError(f"{path}: not UTF-8 text (invalid byte at offset "
                                   f"{offset - held + e.start}); convert it, e.g. with "
                                   "iconv -t UTF-8") from None

    with _open(path) as fh:
        while block := fh.read(_BLOCK):
            pending += decode(block)
            offset += len(block)
            cut = pending.rfind("\n") + 1
            if not cut and len(pending) > 4 * _BLOCK:  # no newline for long: cut anyway
                cut = len(pending)
            if cut:
                yield pending[:cut]
                pending = pending[cut:]
    pending += decode(b"")
    if pending:
        yield pending


def _jsonl_text(path: Path, lineno: int, raw: bytes) -> str:
    where = f"{path}, line {lineno}"
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{where}: not UTF-8 text (invalid byte at column "
                               f"{e.start + 1})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{where}: not JSON: {e.msg} (column {e.colno})") from None
    text = obj.get("text") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise CalibrationError(f'{where}: no "text" string; a .jsonl line is an object '
                               '{"text": "..."}')
    return text


class Documents:
    """The calibration text of files, folders (their .txt/.rst/.md/.jsonl files) and pipes,
    read only as it is consumed, so that files of several GB cost what the tokens asked
    for need. A document is a file read as plain text, or one line of a .jsonl file (its
    "text" field). Iterating yields each document as an iterable of text pieces; ``count``
    is how many documents were begun."""

    def __init__(self, paths: list[str]):
        self.paths = list(paths)
        self.files: list[Path] = []
        for p in map(Path, self.paths):
            if p.is_dir():
                self.files += sorted(f for f in p.rglob("*")
                                     if f.suffix in TEXT_SUFFIXES and f.is_file())
            elif p.exists():  # a file, or a pipe: --text <(zcat corpus.txt.gz)
                self.files.append(p)
            else:
                raise CalibrationError(f"calibration text not found: {p}")
        self.count = 0
        self._order = None  # shuffle(): (file, byte offset, line) arrays and a permutation

    def shuffle(self, seed: int) -> None:
        """Read the documents in a seeded random order (a sample of all the text, not its
        first documents). Indexes every .jsonl line once (a pass over the files)."""
        files, offsets, lines = array("l"), array("q"), array("q")

        def add(i: int, offset: int, line: int) -> None:
            files.append(i)
            offsets.append(offset)
            lines.append(line)

        for i, f in enumerate(self.files):
            if not f.is_file():
                raise CalibrationError(f"--shuffle-docs reads documents in a random order, "
                                       f"which needs files: {f} is not a regular file")
            if f.suffix != ".jsonl":
                add(i, -1, 0)  # the whole file
                continue
            with _open(f) as fh:
                pos = 0
                for n, raw in enumerate(fh, 1):
                    if raw.strip():
                        add(i, pos, n)
                    pos += len(raw)
        perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed))
        self._order = (files, offsets, lines, perm)

    def __iter__(self):
        for doc in self._in_file_order() if self._order is None else self._shuffled():
            self.count += 1
            yield doc

    def _in_file_order(self):
        for f in self.files:
            if f.suffix != ".jsonl":
                yield _text_pieces(f)
                continue
            with _open(f) as fh:
                for n, raw in enumerate(fh, 1):
                    if raw.strip():
                        yield [_jsonl_text(f, n, raw)]

    def _shuffled(self):
        files, offsets, lines, perm = self._order
        with contextlib.ExitStack() as stack:
            handles = {}
            for j in perm.tolist():
                f = self.files[files[j]]
                if offsets[j] < 0:
                    yield _text_pieces(f)
                    continue
                if f not in handles:
                    handles[f] = stack.enter_context(_open(f))
                handles[f].seek(offsets[j])
                yield [_jsonl_text(f, lines[j], handles[f].readline())]


def read_documents(paths: list[str]) -> Documents:
    """The calibration text of ``paths`` (files and folders of .txt/.rst/.md, or .jsonl
    with a "text" field), to pass to token_sequences."""
    return Documents(paths)


def token_sequences(tokenizer, docs, seq_len: int, max_tokens: int,
                    shuffle_seed: int | None = None, pack: bool = False) -> list[list[int]]:
    """Documents (``Documents``, or a list of strings) cut into sequences of at most
    ``seq_len`` tokens, BOS first if any, until ``max_tokens``: in file order, or in a
    seeded random order (a sample of the whole text, not its first documents). Reads the
    documents only as far as that needs. Sequences under ``MIN_TOKENS`` are skipped.
    ``pack``: documents joined (a blank line between) before the cut, so that every sequence
    but the last has ``seq_len`` tokens however short the documents are: statistics from
    every position up to ``seq_len``, which long contexts read."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    step = seq_len - len(bos)
    if shuffle_seed is not None:
        if isinstance(docs, Documents):
            docs.shuffle(shuffle_seed)
        else:
            gen = torch.Generator().manual_seed(shuffle_seed)
            docs = [docs[i] for i in torch.randperm(len(docs), generator=gen)]
    seqs, total, longest = [], 0, 0
    for doc in [_joined(docs)] if pack else docs:
        length = 0
        for ids in _chunks(tokenizer, [doc] if isinstance(doc, str) else doc, step):
            length += len(ids)
            chunk = (bos + ids)[: max_tokens - total]
            if len(chunk) < MIN_TOKENS:
                continue
            seqs.append(chunk)
            total += len(chunk)
            if max_tokens - total < MIN_TOKENS:
                return seqs
        longest = max(longest, length)
    if seqs:
        return seqs
    where = " ".join(docs.paths) if isinstance(docs, Documents) else "the documents"
    if not longest:
        raise CalibrationError(f"no text found in {where} (folders are searched for files "
                               f"ending in {', '.join(TEXT_SUFFIXES)})")
    raise CalibrationError(f"no document in {where} has the {MIN_TOKENS - len(bos)} tokens a "
                           f"sequence needs (the longest has {longest}); give longer documents")


def mix_lengths(seqs: list[list[int]], lengths: list[int], bos: int | None) -> list[list[int]]:
    """``seqs`` (of the longest of ``lengths``) shared out in turn among ``lengths``, each
    recut into sequences of its length, BOS first if any: about the same number of tokens
    for every length, so that the early positions short prompts read weigh as much in the
    statistics as the far ones only long prompts reach. Pieces under ``MIN_TOKENS`` are
    dropped."""
    if len(lengths) == 1:
        return seqs
    head = [] if bos is None else [bos]
    out = []
    for i, seq in enumerate(seqs):
        length = lengths[i % len(lengths)]
        body = seq[len(head):]
        step = length - len(head)
        out += [head + body[s : s + step] for s in range(0, len(body), step)
                if len(body[s : s + step]) + len(head) >= MIN_TOKENS]
    return out


def _joined(docs):
    """The documents' text pieces as one document's, a blank line between documents."""
    for k, doc in enumerate(docs):
        if k:
            yield "\n\n"
        yield from [doc] if isinstance(doc, str) else doc


def _chunks(tokenizer, pieces, step: int):
    """One document's token ids (its text pieces tokenized in turn) in runs of ``step``,
    the last one shorter."""
    buf = []
    for piece in pieces:
        buf += tokenizer(piece, add_special_tokens=False)["input_ids"]
        full = len(buf) - len(buf) % step
        yield from (buf[s : s + step] for s in range(0, full, step))
        buf = buf[full:]
    if buf:
        yield buf


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


@dataclass
class LayerStats:
    """What one layer's attention saw: sampled K/V rows (post-RoPE, and pre-RoPE when
    asked), the attention mass each sampled row received from queries that read it
    through codes, and the query second moment and o_proj metric per KV head."""

    k: list = field(default_factory=list)  # [n, H, d] fp16 chunks
    v: list = field(default_factory=list)
    k_pre: list = field(default_factory=list)
    mass: list = field(default_factory=list)  # [n, H] fp32 chunks
    qa: torch.Tensor | None = None  # [H, d, d] float64
    og: torch.Tensor | None = None  # [H, d, d] o_proj metric: sum over the group of W^T W
    sink: tuple | None = None  # (k [H, d], v [H, d]) of the BOS token at position 0
    gk: list = field(default_factory=list)  # [n, H, d] fp32: d loss / d k through coded reads
    gv: list = field(default_factory=list)  # (capture(fisher=True) only)
    held: dict = field(default_factory=dict, repr=False)  # name -> rows, while held_on

    def rows(self, name: str) -> torch.Tensor:
        if name in self.held:
            return self.held[name]
        return torch.cat(getattr(self, name)).float()

    @contextlib.contextmanager
    def held_on(self, device):
        """The sampled rows joined and moved to ``device`` once, for the several trainings
        and costs of one layer (choose_bits), instead of at every use; let go after."""
        self.held = {name: self.rows(name).to(device)
                     for name in ("k", "v", "mass", "gk", "gv") if getattr(self, name)}
        try:
            yield
        finally:
            self.held = {}


QUERY_BLOCK = 2048  # queries per attention block in KVCapture


class _Blocks:
    """A sequence's queries in blocks, and what a block of queries sees: the attention
    probabilities (causal, the layer's sliding window if any, as transformers and vLLM: key
    j > i - sliding_window; learned sink logits in the softmax) and which keys it reads
    through codes (``j < window_start(i)``, position 0 not when the sink is pinned)."""

    def __init__(self, t, block, scale, sliding_window, learned_sinks, window, pinned, device):
        self.t, self.block, self.scale = t, block, scale
        self.sliding_window, self.learned_sinks = sliding_window, learned_sinks
        self.window, self.pinned = window, pinned
        self.pos = torch.arange(t, device=device)

    @classmethod
    def of(cls, query, key, scaling, sliding_window, softcap, kwargs, block, window, pinned):
        """The blocks of one call of a transformers attention function."""
        if softcap:
            raise CalibrationError("attention logit soft-capping is not supported by the "
                                   "CUSTOM backend (nor by its calibration)")
        hq, t, d = query.shape[1], key.shape[2], key.shape[-1]
        scale = scaling if scaling is not None else d**-0.5
        # gpt-oss's learned per-head sink logits (transformers passes them as s_aux): they
        # join every row's softmax denominator, so the mass each key receives, and the
        # output the next layers see, are the served model's
        s_aux = kwargs.get("s_aux")
        learned_sinks = None if s_aux is None else s_aux.detach().float().view(hq, 1, 1)
        return cls(t, block, scale, sliding_window, learned_sinks, window, pinned, query.device)

    def __iter__(self):
        return ((lo, min(lo + self.block, self.t)) for lo in range(0, self.t, self.block))

    def probs(self, qb, kr, lo, hi, kr_coded=None):
        """``kr_coded``: the keys as read through codes, where the block reads codes."""
        i = self.pos[lo:hi].view(-1, 1)
        causal = self.pos.view(1, -1) <= i
        if self.sliding_window:
            causal &= self.pos.view(1, -1) > i - self.sliding_window
        s = qb @ kr.transpose(1, 2)
        if kr_coded is not None:
            s = torch.where(self.coded(lo, hi), qb @ kr_coded.transpose(1, 2), s)
        p = (s * self.scale).masked_fill(~causal, float("-inf"))
        if self.learned_sinks is None:
            return p.softmax(-1)
        # a column that takes mass and gives no value
        sinks = self.learned_sinks.expand(-1, hi - lo, 1)
        return torch.cat([p, sinks], -1).softmax(-1)[..., :-1]

    def coded(self, lo, hi):
        coded = self.pos.view(1, -1) < window_start(self.pos[lo:hi], self.window).view(-1, 1)
        if self.pinned:
            coded[:, 0] = False
        return coded


class _CodedReads(torch.autograd.Function):
    """The capture's attention output, differentiable: backward recomputes the
    probabilities a block of queries at a time (memory as the forward's) and, besides the
    gradients of q, k and v, records the part of d loss / d k and d loss / d v that comes
    through reads as codes, for the sampled rows: what an error of that key or value
    costs the loss where serving reads it from codes (Fisher weights, Method.k_fisher)."""

    @staticmethod
    def forward(ctx, query, key, value, out, blocks, st, rows):
        ctx.save_for_backward(query, key, value, out)
        ctx.blocks, ctx.st, ctx.rows = blocks, st, rows
        return out.clone()

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out = ctx.saved_tensors
        b = ctx.blocks
        hq, hkv = query.shape[1], key.shape[1]
        g = hq // hkv
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        kr, vr = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        dout = dout.float()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
        gk, gv = torch.zeros_like(kr), torch.zeros_like(vr)
        for lo, hi in b:
            qb, dob = q[:, lo:hi], dout[:, lo:hi]
            p = b.probs(qb, kr, lo, hi)
            delta = (dob * out[:, lo:hi]).sum(-1, keepdim=True)  # sum_j p_j dP_j
            ds = p * (dob @ vr.transpose(1, 2) - delta) * b.scale
            dq[:, lo:hi] = ds @ kr
            dk += ds.transpose(1, 2) @ qb
            dv += p.transpose(1, 2) @ dob
            coded = b.coded(lo, hi)
            gk += (ds * coded).transpose(1, 2) @ qb
            gv += (p * coded).transpose(1, 2) @ dob
        per_kv = lambda x: x.view(hkv, g, *x.shape[1:]).sum(1)  # noqa: E731
        for name, x in (("gk", gk), ("gv", gv)):
            getattr(ctx.st, name).append(per_kv(x)[:, ctx.rows].transpose(0, 1).cpu())
        return (dq[None].to(query.dtype), per_kv(dk)[None].to(key.dtype),
                per_kv(dv)[None].to(value.dtype), None, None, None, None)


class KVCapture:
    """A transformers attention function that records what calibration needs, then
    computes the attention itself (from the probabilities it already has).

    ``window`` is the serving window: a query at i reads key j through codes iff
    ``j < window_start(i)``, and only such reads make the statistics. Position 0 is left
    out of them when ``pinned_sink``: its codes are exact."""

    NAME = "pq_capture"

    def __init__(self, num_layers: int, keep_fraction: float, seed: int, window: int,
                 pre_rope: bool = False, fisher: bool = False):
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.fisher = fisher  # record d loss / d K, V through coded reads in backward
        self.keep = keep_fraction
        self.gen = torch.Generator().manual_seed(seed)
        self.window = window
        self.pre_rope = pre_rope
        self.rows: torch.Tensor | None = None
        self.query_block = QUERY_BLOCK
        self.rope: tuple | None = None  # (cos, sin) [T, d] of the current sequence
        self.sink_pass = False
        # layers that recorded the current sequence: a checkpointed layer runs again in
        # backward (_layers_checkpointed), and that second run records nothing
        self.recorded: set[int] = set()

    def new_sequence(self, length: int, rope=None, sink_pass: bool = False) -> None:
        n = max(1, round(length * self.keep))
        self.rows = torch.randperm(length, generator=self.gen)[:n]
        self.rope = rope
        self.sink_pass = sink_pass
        self.recorded = set()

    def __call__(self, module, query, key, value, attention_mask, scaling=None,
                 sliding_window=None, softcap=None, **kwargs):
        """The layer's attention (causal, its sliding window if any, as transformers and
        vLLM: key j > i - sliding_window), recording the statistics on the way."""
        st = self.layers[module.layer_idx]
        record = module.layer_idx not in self.recorded and not self.sink_pass
        self.recorded.add(module.layer_idx)
        hq, hkv, t, d = query.shape[1], key.shape[1], key.shape[2], key.shape[-1]
        g = hq // hkv
        # detached: the statistics build no graph; with fisher, _CodedReads is the gradient
        q, k, v = (x[0].detach().float() for x in (query, key, value))  # [H, T, d]
        kr, vr = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        blocks = _Blocks.of(query, key, scaling, sliding_window, softcap, kwargs,
                            self.query_block, self.window, st.sink is not None)
        out = torch.empty_like(q)  # [Hq, T, d]
        mass = torch.zeros(hq, t, device=q.device)  # attention each key received as codes
        qa = torch.zeros(hq, d, d, device=q.device)
        # queries in blocks, so that memory grows with T x block, not T^2: long sequences
        # (--seq-len up to the model's context) calibrate in bounded memory
        for lo, hi in blocks:
            qb = q[:, lo:hi]
            p = blocks.probs(qb, kr, lo, hi)
            out[:, lo:hi] = p @ vr
            if not record:
                continue
            pc = p * blocks.coded(lo, hi)
            mass += pc.sum(1)
            share = pc.sum(2)  # [Hq, b] each query's attention to coded keys
            qa += torch.einsum("hi,hid,hie->hde", share, qb, qb)
        if self.sink_pass:
            st.sink = (k[:, 0].cpu(), v[:, 0].cpu())
            return out.transpose(0, 1)[None].to(query.dtype), None
        rows = self.rows.to(q.device)
        if self.fisher and torch.is_grad_enabled():
            out = _CodedReads.apply(query, key, value, out, blocks, st, rows)
        out = out.transpose(0, 1)[None].to(query.dtype)  # [1, T, Hq, d]
        if not record:  # the recomputation of a checkpointed layer
            return out, None
        mass = mass.view(hkv, g, t).sum(1)  # [Hkv, T]
        qa = qa.view(hkv, g, d, d).sum(1)
        st.qa = qa.double().cpu() if st.qa is None else st.qa + qa.double().cpu()
        if st.og is None and hasattr(module, "o_proj"):
            w = module.o_proj.weight.float().view(-1, hkv, g, d)  # [hidden, Hkv, g, d]
            st.og = torch.einsum("okgd,okge->kde", w, w).double().cpu()
        st.k.append(k[:, rows].transpose(0, 1).to("cpu", torch.float16))
        st.v.append(v[:, rows].transpose(0, 1).to("cpu", torch.float16))
        st.mass.append(mass[:, rows].T.cpu())
        if self.pre_rope:  # undo the rotation: R(-theta) k
            cos, sin = (x[rows].float() for x in self.rope)
            kk = k[:, rows]
            st.k_pre.append((kk * cos - rotate_half(kk) * sin).transpose(0, 1).to("cpu", torch.float16))
        return out, None


LOSS_CHUNK = 1024  # positions whose logits exist at once in _loss_backward


@contextlib.contextmanager
def _layers_checkpointed(model):
    """The model's decoder layers recompute their activations in backward (transformers'
    GradientCheckpointingLayer, torch's non-reentrant checkpoint) instead of keeping them,
    so that the loss's backward holds each layer's input and one layer's activations at a
    time, not every layer's: an 8B model's activations at 32K tokens alone would fill a
    GPU. Only the layers themselves are put in training mode (their gate for it); their
    submodules, dropout among them, stay in eval mode."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [(m.training, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
              for m in layers]
    for m in layers:
        m.training, m.gradient_checkpointing = True, True
        m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for m, (training, on, func) in zip(layers, before):
            m.training, m.gradient_checkpointing = training, on
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func


def _logits_of(model):
    """The model's next-token logits (fp32) from its last hidden states."""
    head, cap = model.get_output_embeddings(), getattr(model.config.get_text_config(),
                                                       "final_logit_softcapping", None)

    def logits(h):
        out = head(h).float()
        return torch.tanh(out / cap) * cap if cap else out

    return logits


def _loss_backward(model, ids: torch.Tensor) -> None:
    """Backpropagate the sequence's next-token loss (summed) to its K and V, for
    KVCapture's Fisher rows, the decoder layers checkpointed (_layers_checkpointed). The
    logits are made a chunk of positions at a time and recomputed in backward (a 32K-token
    sequence of a 262K-word vocabulary would otherwise hold tens of GB of them)."""
    from torch.utils.checkpoint import checkpoint

    logits_of = _logits_of(model)

    def chunk_loss(h, target):
        return torch.nn.functional.cross_entropy(logits_of(h), target, reduction="sum")

    emb = model.get_input_embeddings()(ids).detach().requires_grad_()  # a graph to the start
    n = ids.shape[1] - 1
    with _layers_checkpointed(model):
        hidden = model.get_decoder()(inputs_embeds=emb, use_cache=False).last_hidden_state[0]
        loss = sum(checkpoint(chunk_loss, hidden[a : min(a + LOSS_CHUNK, n)],
                              ids[0, a + 1 : min(a + LOSS_CHUNK, n) + 1], use_reentrant=False)
                   for a in range(0, n, LOSS_CHUNK))
        loss.backward()


def capture(model, tok, seqs, keep_fraction: float, seed: int, window: int, device,
            pre_rope: bool = False, progress: bool = True,
            fisher: bool = False) -> list[LayerStats]:
    """Run the model over ``seqs`` and return the statistics of every layer; ``fisher``:
    also backpropagate each sequence's loss and keep the sampled rows' gradients through
    coded reads (LayerStats.gk, .gv)."""
    from tqdm import tqdm
    from transformers import AttentionInterface

    cap = KVCapture(model.config.num_hidden_layers, keep_fraction, seed, window, pre_rope,
                    fisher)
    AttentionInterface.register(KVCapture.NAME, cap)
    model.config._attn_implementation = KVCapture.NAME
    rotary = getattr(model.model, "rotary_emb", None)
    if pre_rope and rotary is None:
        raise CalibrationError("pre-RoPE keys need a model with model.rotary_emb (Llama family)")

    def rope(n):
        if not pre_rope:
            return None
        pos = torch.arange(n, device=device)[None]
        cos, sin = rotary(torch.zeros(1, device=device, dtype=torch.float32), pos)
        return cos[0], sin[0]

    with torch.inference_mode():
        if tok.bos_token_id is not None:
            cap.new_sequence(1, sink_pass=True)
            model(torch.tensor([[tok.bos_token_id]], device=device))
    model.requires_grad_(False)
    for ids in tqdm(seqs, desc="forward and backward passes" if fisher else "forward passes",
                    unit="seq", disable=not progress):
        cap.new_sequence(len(ids), rope(len(ids)))
        x = torch.tensor([ids], device=device)
        if fisher:
            with torch.enable_grad():
                _loss_backward(model, x)
        else:
            with torch.inference_mode():
                model(x)
    return cap.layers


@dataclass(frozen=True)
class Method:
    """How codebooks are trained (see the module docstring). The defaults are the best
    configuration measured (README, eval/results/accuracy.json)."""

    k_gamma: float = 0.5  # exponent of the query metric for K (0: plain L2 on k)
    k_rotate: bool = True  # principal axes of k', balanced over subspaces
    k_alpha: float = 0.0  # K tokens weighted by attention mass ** alpha
    v_gamma: float = 0.0  # exponent of the o_proj metric for V (0: plain L2 on v); see
    # default_method for the default at 2 bits and fewer
    v_rotate: bool = True
    v_alpha: float = 0.5  # V tokens weighted by attention mass ** alpha
    # > 0: tokens weighted per subspace by their Fisher information ** this instead of mass
    # (the squared gradient of the loss through coded reads, as CQ weights its k-means)
    k_fisher: float = 0.0
    v_fisher: float = 0.0
    niter: int = 25

    @property
    def fisher(self) -> bool:
        return self.k_fisher > 0 or self.v_fisher > 0


# V at <= 2 bits per element trains in the o_proj metric: in vLLM it took 0.07-0.18 points
# off every domain's perplexity at K4/V2 and K2/V2 (eval/results/accuracy.json); at 4 bits
# it measured neutral in simulation (docs/results.md), so 4 bits keeps plain L2 on v.
LOW_BIT_V_GAMMA = 0.5


def default_method(bits_v: float, niter: int = Method.niter) -> Method:
    return Method(niter=niter, v_gamma=LOW_BIT_V_GAMMA if bits_v <= 2 else 0.0)


def _sym_power(a: torch.Tensor, power: float) -> torch.Tensor:
    """``a [H, d, d]`` symmetric PSD -> a^power, eigenvalues floored at 1e-6 of the top."""
    w, u = torch.linalg.eigh(a.double())
    w = w.clamp_min(w.amax(-1, keepdim=True) * 1e-6) ** power
    w = w / w.square().mean(-1, keepdim=True).sqrt()  # rms 1: k' stays the size of k
    return (u * w.unsqueeze(-2)) @ u.transpose(-1, -2)


def balanced_axes(x: torch.Tensor, m: int) -> torch.Tensor:
    """Orthogonal ``[H, d, d]``: principal axes of ``x [n, H, d]`` as columns, dealt to the
    m subspaces (consecutive column groups) greedily, largest variance first, each to the
    open subspace whose log-variance sum is lowest (OPQ's eigenvalue allocation)."""
    n, h, d = x.shape
    ds = d // m
    xc = x.double() - x.double().mean(0)
    cov = torch.einsum("nhd,nhe->hde", xc, xc) / n
    w, u = torch.linalg.eigh(cov)  # ascending
    out = torch.empty_like(u)
    for hi in range(h):
        logw = w[hi].clamp_min(w[hi].max() * 1e-12).log().tolist()
        slots = [[] for _ in range(m)]
        score = [0.0] * m
        for j in sorted(range(d), key=lambda j: -logw[j]):
            b = min((s for s in range(m) if len(slots[s]) < ds), key=lambda s: score[s])
            slots[b].append(j)
            score[b] += logw[j]
        out[hi] = u[hi][:, [j for s in slots for j in s]]
    return out


def _weights(mass: torch.Tensor, alpha: float) -> torch.Tensor | None:
    """``mass [n, H]`` (or ``[n, H, m]``, per subspace) -> k-means weights ``[H, n]`` (or
    ``[H, m, n]``); tokens no query read as codes keep a small weight (longer contexts than
    the calibration's will read them)."""
    if alpha == 0:
        return None
    w = (mass + 0.05 * mass.mean(0, keepdim=True)).clamp_min(1e-12) ** alpha
    return torch.movedim(w / w.mean(0, keepdim=True), 0, -1)


def _fisher(grad: torch.Tensor, transform: torch.Tensor | None, m: int) -> torch.Tensor:
    """Fisher information of each row per subspace of the trained space, ``[n, H, m]``:
    the squared gradient ``grad [n, H, d]`` mapped as rows are (x' = x T, so the
    gradient by x' is g T^-T), summed over each subspace's dimensions."""
    g = grad if transform is None else torch.einsum(
        "nhd,hed->nhe", grad, torch.linalg.inv(transform.double()).to(grad))
    n, h, d = g.shape
    return g.square().view(n, h, m, d // m).sum(-1)


def _pin(cents: torch.Tensor, x: torch.Tensor) -> None:
    """Make ``x [H, d]`` exact: per subspace, its nearest centroid becomes it, never the
    marker's slot (``NAN_CODE`` of subspace 0, NaN while serving: codebooks.nan_marked).

    Used for the first token's K/V (the attention sink): nearly every query puts much of
    its attention there, so its error reaches every output, and it is a single far-out
    point k-means gives no centroid of its own (SmolLM2, 4 bits, W=0: +39% perplexity
    over bf16 unpinned, +6% pinned)."""
    h, m, _, ds = cents.shape
    xs = x.view(h, m, 1, ds)
    dist = ((cents - xs) ** 2).sum(-1)  # [H, m, 256]
    dist[:, 0, NAN_CODE] = float("inf")
    idx = dist.argmin(-1)  # [H, m]
    cents[torch.arange(h)[:, None], torch.arange(m)[None], idx] = xs[:, :, 0]


def train_quantizer(x, m, weights, transform, niter, seed, sink=None):
    """k-means of ``x [n, H, d]`` mapped by ``transform [H, d, d]`` (or None), M subspaces.
    Returns centroids ``[H, m, 256, d/m]`` (in the mapped space) and rel. error ``[H]``.

    Subspace 0 trains one centroid fewer: its slot ``NAN_CODE`` is the serving's marker
    of non-finite K/V, and holds a copy of code 0 (codebooks.reserve_nan_code), so the
    marker takes no centroid that anything, the pinned sink included, is coded with."""
    n, h, d = x.shape
    ds = d // m
    if transform is not None:
        x = torch.einsum("nhd,hde->nhe", x, transform.to(x))
    xs = x.view(n, h, m, ds).permute(1, 2, 0, 3).contiguous()  # [H, m, n, ds]
    w = None if weights is None else weights.to(x)  # [H, n], or [H, m, n] per subspace
    if w is not None and w.dim() == 2:
        w = w.unsqueeze(1).expand(h, m, n)
    cents = x.new_empty(h, m, NUM_CENTROIDS, ds)
    err = x.new_empty(h, m)
    free = [c for c in range(NUM_CENTROIDS) if c != NAN_CODE]
    cents[:, 0, free], err[:, 0] = kmeans(xs[:, 0], None if w is None else w[:, 0],
                                          NUM_CENTROIDS - 1, niter, seed)
    if m > 1:
        c, e = kmeans(xs[:, 1:].reshape(h * (m - 1), n, ds),
                      None if w is None else w[:, 1:].reshape(h * (m - 1), n),
                      NUM_CENTROIDS, niter, seed + 1)
        cents[:, 1:], err[:, 1:] = c.view(h, m - 1, NUM_CENTROIDS, ds), e.view(h, m - 1)
    if sink is not None:
        s = sink.to(x)
        _pin(cents, s if transform is None else torch.einsum("hd,hde->he", s, transform.to(x)))
    reserve_nan_code(cents)
    return cents, err.mean(1)


def _map(x, metric, gamma: float, rotate: bool, m: int, device):
    """The linear map codes are trained in: ``metric^(gamma/2)`` (a [H, d, d] second
    moment, trace-normalized), then the balanced principal axes of the mapped rows."""
    t = None
    if gamma:
        metric = metric / metric.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)
        t = _sym_power(metric, gamma / 2).float().to(device)
    if rotate:
        r = balanced_axes(x if t is None else torch.einsum("nhd,hde->nhe", x, t), m).float()
        t = r if t is None else t @ r
    return t


def _train_part(st: LayerStats, part: str, m: int, method: Method, seed: int, device):
    """K's (``part`` "k") or V's ("v") codebook of one layer: (centroids, transform or
    None, relative error per head)."""
    x = st.rows(part).to(device)
    metric, gamma, rotate, alpha, fisher = (
        (st.qa, method.k_gamma, method.k_rotate, method.k_alpha, method.k_fisher) if part == "k"
        else (st.og, method.v_gamma, method.v_rotate, method.v_alpha, method.v_fisher))
    t = _map(x, metric, gamma, rotate, m, device)
    if not fisher:
        w = _weights(st.rows("mass").to(device), alpha)
    elif getattr(st, "g" + part):
        w = _weights(_fisher(st.rows("g" + part).to(device), t, m), fisher)
    else:
        raise CalibrationError(f"Method {part}_fisher needs capture(fisher=True)")
    sink = None if st.sink is None else st.sink[part == "v"]
    cents, err = train_quantizer(x, m, w, t, method.niter, seed + (part == "v"), sink)
    return cents, t, err


def train_layer(st: LayerStats, m_k: int, m_v: int, method: Method, seed: int, device,
                k_part: tuple | None = None, v_part: tuple | None = None):
    """Codebooks and maps of one layer: dict of k/v centroids, k/v transforms (or None),
    relative errors. ``k_part``, ``v_part``: K's and V's, already trained (_train_part's
    results)."""
    kc, tk, ek = k_part or _train_part(st, "k", m_k, method, seed, device)
    vc, tv, ev = v_part or _train_part(st, "v", m_v, method, seed, device)
    return dict(k=kc, v=vc, k_transform=tk, v_transform=tv, err_k=ek, err_v=ev)


def reconstruct(x: torch.Tensor, cents: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """Rows ``x [n, H, d]`` as serving reads them back: the codes of ``x t`` decoded and
    mapped back by ``t^-1`` (t None: identity)."""
    from .reference import decode_codes, encode

    xt = x if t is None else torch.einsum("nhd,hde->nhe", x, t)
    rec = decode_codes(encode(xt, cents), cents)
    if t is not None:
        rec = torch.einsum("nhe,hed->nhd", rec, torch.linalg.inv(t.double()).to(rec))
    return rec


COST_SEQS = 8  # sequences measured_costs runs; every second one ends in a copied span
COST_SEQ_LEN = 4096  # their most tokens: far enough for reads through codes at distance;
# each candidate costs a forward pass of every one, and attention grows with length squared


def cost_sequences(seqs: list[list[int]], window: int, seed: int) -> list[list[int]]:
    """What measured_costs scores: ``COST_SEQS`` of the calibration sequences (seeded), cut to
    ``COST_SEQ_LEN`` tokens, every second one with its last eighth replaced by a copy of an
    earlier span that lies beyond the window, so read through codes. Copying from far back
    is what retrieval (passkeys, quoting) does, and plain text rarely needs it: a cost on
    plain text alone rates the layers that do it as cheap (docs/design.md)."""
    import random

    rng = random.Random(seed)
    picked = rng.sample(seqs, min(COST_SEQS, len(seqs)))
    out = []
    for i, s in enumerate(picked):
        s = s[:COST_SEQ_LEN]
        n, span = len(s), len(s) // 8
        last = n - 2 * span - window  # the latest start whose span ends a window back
        if i % 2 and span and last >= 1:
            a = rng.randint(1, last)
            s = s[: n - span] + s[a : a + span]
        out.append(s)
    return out


class CodedLayer:
    """A transformers attention function with one layer's K or V read through codes where
    serving reads them (``_Blocks.coded``), every other read exact: the model as served
    with only that part coded (measured_costs)."""

    NAME = "pq_coded_layer"

    def __init__(self, window: int, pinned: list[bool]):
        self.window, self.pinned = window, pinned  # pinned: per layer, position 0 exact
        self.query_block = QUERY_BLOCK
        self.target = None  # (layer, "k" or "v", centroids, transform), or None: all exact

    def __call__(self, module, query, key, value, attention_mask, scaling=None,
                 sliding_window=None, softcap=None, **kwargs):
        i = module.layer_idx
        g = query.shape[1] // key.shape[1]
        q, k, v = (x[0].float() for x in (query, key, value))  # [H, T, d]
        blocks = _Blocks.of(query, key, scaling, sliding_window, softcap, kwargs,
                            self.query_block, self.window, self.pinned[i])
        kr, vr = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        kc = vc = None
        if self.target is not None and self.target[0] == i:
            _, part, cents, t = self.target
            x = (k if part == "k" else v).transpose(0, 1)  # [T, H, d]
            coded = reconstruct(x, cents, t).transpose(0, 1).repeat_interleave(g, 0)
            kc, vc = (coded, None) if part == "k" else (None, coded)
        out = torch.empty_like(q)
        for lo, hi in blocks:
            p = blocks.probs(q[:, lo:hi], kr, lo, hi, kc)
            if vc is None:
                out[:, lo:hi] = p @ vr
            else:
                c = blocks.coded(lo, hi)
                out[:, lo:hi] = (p * ~c) @ vr + (p * c) @ vc
        return out.transpose(0, 1)[None].to(query.dtype), None


def measured_costs(model, seqs: list[list[int]], candidates: list[dict], window: int,
                   pinned: list[bool], device, progress: bool = True) -> dict:
    """What coding each layer's K or V with each candidate codebook costs the model's
    predictions, measured: ``candidates`` per layer ``{"k": {label: (centroids, transform)},
    "v": ...}``; returns ``{"k": [per layer {label: cost}], "v": ...}``, the cost the KL
    divergence from the exact model's next-token distribution to the one with only that
    part coded, summed over ``seqs``' positions and divided by their count. Unlike the loss
    (coding_cost), KL sees a confident prediction that codes spoil, such as a copy, whose
    gradient is small. Give a float32 model: in bf16 every change to one layer's reads
    re-rounds every later activation, and that alone costs about 0.0015 (SmolLM2-135M),
    more than most parts' codes do."""
    from tqdm import tqdm
    from transformers import AttentionInterface

    att = CodedLayer(window, pinned)
    AttentionInterface.register(CodedLayer.NAME, att)
    model.config._attn_implementation = CodedLayer.NAME
    logits_of, decoder = _logits_of(model), model.get_decoder()
    runs = [(i, part, label, ct) for i, layer in enumerate(candidates)
            for part in ("k", "v") for label, ct in layer[part].items()]
    total, positions = [0.0] * len(runs), 0

    def hidden(ids):
        return decoder(input_ids=ids, use_cache=False).last_hidden_state[0]

    bar = tqdm(total=len(seqs) * len(runs), desc="KL of each candidate's codes", unit="pass",
               disable=not progress)
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            att.target = None
            ref = hidden(ids)
            for j, (i, part, _, (cents, t)) in enumerate(runs):
                att.target = (i, part, cents, t)
                h = hidden(ids)
                # the exact model's log-probabilities are made again for every candidate:
                # a sequence's whole would hold positions x vocabulary floats (4 GB for
                # Gemma 3 at 4K tokens), and the head costs little beside the decoder
                for a in range(0, len(s), LOSS_CHUNK):
                    lp = logits_of(ref[a : a + LOSS_CHUNK]).log_softmax(-1)
                    lq = logits_of(h[a : a + LOSS_CHUNK]).log_softmax(-1)
                    total[j] += float((lp.exp() * (lp - lq)).sum())
                bar.update()
            positions += len(s)
    bar.close()
    costs = {"k": [{} for _ in candidates], "v": [{} for _ in candidates]}
    for (i, part, label, _), c in zip(runs, total):
        costs[part][i][label] = max(0.0, c / positions)  # KL >= 0; rounding can dip below
    return costs


# The trainings of K that --fit-k measured tries in every layer (Method fields over the
# method's own): the query metric at exponent 1 (the exact score error) instead of 0.5,
# tokens weighted by attention mass^0.5, both. Which is best differs by layer, and in a few
# layers the default's error is many times the others' (docs/results.md, K's training by
# layer).
K_FITS = {"default": {}, "query": dict(k_gamma=1.0), "mass": dict(k_alpha=0.5),
          "query+mass": dict(k_gamma=1.0, k_alpha=0.5)}


def fit_k(stats, model, seqs, m_ks: list[int], method: Method, seed: int, window: int, device,
          progress: bool = True):
    """Each layer's K trained every way of ``K_FITS`` (over ``method``) at its ``m_ks``
    width, each priced by measured_costs on ``seqs`` (cost_sequences), the cheapest kept.
    Returns each layer's K as trained (_train_part's result), its training's name, and the
    costs ``[per layer {name: KL}]``."""
    trained = []
    for st, mk in zip(stats, m_ks):
        with st.held_on(device):
            trained.append({name: _train_part(st, "k", mk, replace(method, **over), seed, device)
                            for name, over in K_FITS.items()})
    pinned = [st.sink is not None for st in stats]
    costs = measured_costs(model, seqs, [{"k": {n: (c, t) for n, (c, t, _) in layer.items()}, "v": {}}
                            for layer in trained], window, pinned, device, progress)["k"]
    names = [min(c, key=c.get) for c in costs]
    return [layer[n] for layer, n in zip(trained, names)], names, costs


def coding_cost(st: LayerStats, part: str, cents: torch.Tensor, t: torch.Tensor | None,
                device) -> float:
    """What coding this layer's K (``part`` "k") or V ("v") with centroids ``cents`` (in
    the space of map ``t``) costs the loss, to second order with the empirical Fisher: the
    sum over the sampled rows of ``(g . e)^2``, g the row's gradient through coded reads
    (capture(fisher=True)), e its coding error."""
    if not getattr(st, "g" + part):
        raise CalibrationError("the cost of codes by layer needs capture(fisher=True)")
    x, g = st.rows(part).to(device), st.rows("g" + part).to(device)
    rec = reconstruct(x, cents.to(device), None if t is None else t.to(device))
    return float(((x - rec) * g).sum(-1).double().square().sum())


def allocate_bits(costs: list[dict[float, float]], mean: float) -> list[float]:
    """Each layer's bits (a key of its ``costs``, bits -> cost) so that their mean is at
    most ``mean`` and the summed cost is least: an exact knapsack over the total bits, in
    eighths of a bit (every width is a multiple of 8/head_dim, at least 1/8 for the
    head sizes served)."""
    unit = 8
    budget = int(mean * len(costs) * unit + 1e-6)
    best = {0: (0.0, [])}  # total units -> (cost, choices)
    for layer in costs:
        step = {}
        for used, (cost, picks) in best.items():
            for bits, c in layer.items():
                u = used + round(bits * unit)
                if u <= budget and (u not in step or cost + c < step[u][0]):
                    step[u] = (cost + c, picks + [bits])
        best = step
    if not best:
        raise CalibrationError(f"no choice of bits per layer has a mean of {mean} or less")
    return min(best.values(), key=lambda x: x[0])[1]


def train(stats: list[LayerStats], m_k, m_v, method, seed: int, device,
          progress: bool = True, parts: list | None = None) -> dict:
    """Every layer: tensors ``k [L, H, m_k, 256, d/m_k]`` and ``v`` (the same, or lists of
    each layer's ``[H, M, 256, d/M]`` where ``m_k``, ``m_v`` are lists, one per layer, as
    ``method`` may be), transforms ``[L, H, d, d]`` (or None), and mean relative errors per
    layer. ``parts``: each layer's (K, V) already trained (choose_bits), not trained again."""
    from tqdm import tqdm

    def each(x):
        return x if isinstance(x, list) else [x] * len(stats)

    m_ks, m_vs = each(m_k), each(m_v)
    name = lambda ms: ms[0] if len(set(ms)) == 1 else "per layer"  # noqa: E731
    out = []
    for st, mk, mv, meth, (kp, vp) in tqdm(
            list(zip(stats, m_ks, m_vs, each(method), parts or [(None, None)] * len(stats))),
            desc=f"k-means K {name(m_ks)} / V {name(m_vs)} subspaces", unit="layer",
            disable=not progress):
        out.append({key: (val.cpu() if val is not None else None)
                    for key, val in train_layer(st, mk, mv, meth, seed, device, kp, vp).items()})

    def stack(key, listed=False):
        got = [o[key] for o in out]
        if all(x is None for x in got):
            return None
        if key.endswith("transform"):  # layers trained without a map (fit_k): the identity
            eye = next(x for x in got if x is not None)
            got = [torch.eye(eye.shape[-1]).expand_as(eye) if x is None else x for x in got]
        return got if listed else torch.stack(got)

    return dict(k=stack("k", isinstance(m_k, list)), v=stack("v", isinstance(m_v, list)),
                k_transform=stack("k_transform"), v_transform=stack("v_transform"),
                rel_mse_k=[round(float(o["err_k"].mean()), 5) for o in out],
                rel_mse_v=[round(float(o["err_v"].mean()), 5) for o in out])


# Calibration time grows with parameters x tokens (the forward passes): SmolLM2-135M with the
# default 65536 tokens took about 40 minutes on a CPU and 26-31 s on an H100.
CPU_PARAM_TOKENS_PER_S = 135e6 * 65536 / (40 * 60)
BITS = sorted({b for pair in BIT_RATES for b in pair})
DEFAULT_BITS = 4


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """A bad argument in one line, exit status 2 (argparse's would add the usage)."""
        self.exit(2, f"calibrate: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m vllm_pq_backend.calibrate",
        description="Train per-layer, per-KV-head PQ codebooks for the CUSTOM backend.",
    )
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument(
        "--text", required=True, nargs="+",
        help="calibration text: files, pipes or folders (searched for .txt/.rst/.md, and "
             ".jsonl with a 'text' field per line); UTF-8, read only as far as --tokens needs",
    )
    bits = ",".join(map(str, BITS))
    p.add_argument("--bits", "--bits-k", dest="bits", type=int, default=None, choices=BITS,
                   metavar="{%s}" % bits,
                   help="bits per element of K (and of V unless --bits-v): 4 (default), 2 or 1")
    p.add_argument("--bits-v", type=int, default=None, choices=BITS, metavar="{%s}" % bits,
                   help="bits per element of V when it differs from K's (K 4 / V 2: 3 bits "
                        "per element on average)")
    p.add_argument("--bits-v-layers", nargs="+", default=[], metavar="BITS@LAYERS",
                   type=_bits_at_layers,
                   help="other bits per element of V in some layers, e.g. 4@18-23 1@0-11: "
                        "spend V's bits where the model needs them (docs/results.md); the "
                        "file averages its layers' bits")
    p.add_argument("--bits-v-mean", type=float, default=None, metavar="BITS",
                   help="let calibration choose each layer's V bits (those built beside K's: "
                        "4, 2 and 1 with K at 4) for a mean of at most BITS, by what each "
                        "costs the loss (one backward pass per sequence): e.g. --bits 4 "
                        "--bits-v-mean 2 for 3 bits per element on average")
    pairs = ", ".join(f"{bk}/{bv}" for bk, bv in BIT_RATES)
    p.add_argument("--bits-mean", type=float, default=None, metavar="BITS",
                   help="let calibration choose each layer's K and V bits (K/V one of "
                        f"{pairs}) for a mean of at most BITS per element, K and V together, "
                        "by what each costs the loss (one backward pass per sequence): e.g. "
                        "--bits-mean 3")
    p.add_argument("--fit-k", choices=["fixed", "measured"], default="fixed",
                   help="how each layer's K codebook is trained: fixed (default), every layer "
                        "the same way (--method); measured, each layer's K trained %d ways "
                        "(query metric exponent 0.5 or 1, attention-mass weights or none) and "
                        "the one whose codes change the model's next-token distribution least "
                        "kept (KL in float32 over %d calibration sequences, half ending in a "
                        "span copied from far back: %d forward passes per layer and sequence)"
                        % (len(K_FITS), COST_SEQS, len(K_FITS)))
    p.add_argument("--m", type=int, default=None,
                   help="K subspaces per head instead of --bits (head_dim/2 is 4 bits)")
    p.add_argument("--m-v", type=int, default=None,
                   help="V subspaces per head instead of --bits-v (default: as K)")
    p.add_argument("--out", default=None,
                   help="output file (default MODEL/pq/codebooks_m<Mk>[_v<Mv>].safetensors)")
    p.add_argument("--tokens", type=int, default=65536,
                   help=f"calibration tokens to run (default 65536, at least {NUM_CENTROIDS})")
    p.add_argument("--samples", type=int, default=32768,
                   help="K/V rows kept per layer and head for training (default 32768, at "
                        f"least {NUM_CENTROIDS})")
    p.add_argument("--seq-len", type=int, nargs="+", default=None,
                   help="tokens per forward pass (default: the model's context, at most "
                        f"--tokens; at least {MIN_TOKENS}). Several lengths share --tokens "
                        "equally, for codebooks that serve short prompts as well as long ones: "
                        "e.g. --seq-len 2048 8192")
    p.add_argument("--niter", type=int, default=Method.niter, help=f"k-means iterations (default {Method.niter})")
    p.add_argument("--window", type=int, default=None,
                   help="the serving window the statistics assume (default: serving's, 128 "
                        "below the model's sliding window, e.g. 64 for gpt-oss)")
    p.add_argument("--plain", action="store_true",
                   help="plain L2 k-means on K and V (no query metric, rotation or weights)")
    p.add_argument("--method", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override a training setting (fields of calibrate.Method, e.g. "
                        "v_gamma=0.5); for ablations, the defaults are the best measured")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="join documents before cutting them into --seq-len sequences, so that "
                        "each sequence is --seq-len long and the codebooks see keys at every "
                        "position up to it (default; --no-pack cuts each document alone)")
    p.add_argument("--shuffle-docs", action="store_true",
                   help="take --tokens from documents in a seeded random order, not file "
                        "order (indexes every document first: files, not pipes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs and k-means trains: cuda (the default when "
                        "torch sees a GPU), cuda:N for GPU N, or cpu (the default otherwise; "
                        "slow: SmolLM2-135M takes about 40 minutes on a CPU, 30 s on an H100)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model dtype for the forward passes (default bfloat16, as served)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _bits_at_layers(text: str) -> tuple[int, list[int]]:
    """BITS@LAYERS (--bits-v-layers) -> (bits, layer indices)."""
    bits, _, layers = text.partition("@")
    try:
        out = int(bits), parse_layers(layers)
    except ValueError:
        out = None
    if out is None or out[0] not in BITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give BITS@LAYERS with BITS one of {BITS}, e.g. 4@18-23 or 1@0-5,8")
    return out


def _overrides(parser, items: list[str]) -> dict:
    """``FIELD=VALUE`` strings -> Method fields, typed like the defaults."""
    fields = {f.name: type(getattr(Method(), f.name)) for f in dataclasses.fields(Method)}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            parser.error(f"--method {item}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        conv = fields[name]
        try:
            out[name] = value.lower() in ("1", "true", "yes") if conv is bool else conv(value)
        except ValueError:
            parser.error(f"--method {item}: {name} takes a {conv.__name__}")
    return out


def _check_args(parser, args) -> None:
    """What the arguments alone can tell is wrong, before anything is loaded."""
    for name in ("m", "m_v", "tokens", "samples", "niter"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for value in args.seq_len or ():
        if value < MIN_TOKENS:
            parser.error(f"--seq-len must be at least {MIN_TOKENS} (shorter sequences are too "
                         f"short to calibrate with), got {value}")
    for name in ("tokens", "samples"):
        if getattr(args, name) < NUM_CENTROIDS:
            parser.error(f"--{name} must be at least {NUM_CENTROIDS} (k-means trains "
                         f"{NUM_CENTROIDS} centroids per subspace), got {getattr(args, name)}")
    if args.bits_v_mean is not None and (args.bits_v is not None or args.m_v is not None
                                         or args.bits_v_layers):
        parser.error("--bits-v-mean chooses V's bits in every layer: drop --bits-v, --m-v "
                     "and --bits-v-layers")
    given = [flag for flag, value in (("--bits", args.bits), ("--bits-v", args.bits_v),
                                      ("--m", args.m), ("--m-v", args.m_v),
                                      ("--bits-v-layers", args.bits_v_layers),
                                      ("--bits-v-mean", args.bits_v_mean))
             if value not in (None, [])]
    if args.bits_mean is not None and given:
        parser.error(f"--bits-mean chooses K's and V's bits in every layer: drop "
                     f"{', '.join(given)}")
    if args.window is not None and args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        parser.error(f"--device {args.device}: not a device; give cuda, cuda:N or cpu")
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU "
                         "here; run where one is, or give --device cpu (slow)")
        if (device.index or 0) >= n:
            parser.error(f"--device {args.device}: torch sees {n} CUDA GPU(s), cuda:0 to "
                         f"cuda:{n - 1}")


def _subspaces(parser, args, head_dim: int, num_layers: int) -> tuple[int, int, list[int]]:
    """Mk, Mv and each layer's Mv (--bits-v-layers) the arguments ask for, if the kernels
    are built for them."""
    m = args.m if args.m is not None else subspaces(head_dim, args.bits or DEFAULT_BITS)
    if args.m_v is not None:
        m_v = args.m_v
    else:
        m_v = subspaces(head_dim, args.bits_v) if args.bits_v is not None else m
    m_vs = [m_v] * num_layers
    given = [f"--m {args.m}" if args.m is not None else f"--bits {args.bits or DEFAULT_BITS}"]
    if args.m_v is not None:
        given.append(f"--m-v {args.m_v}")
    elif args.bits_v is not None:
        given.append(f"--bits-v {args.bits_v}")
    for bits, layers in args.bits_v_layers:
        if layers[-1] >= num_layers:
            parser.error(f"--bits-v-layers {bits}@{layer_runs(layers)}: the model has "
                         f"{num_layers} layers, 0 to {num_layers - 1}")
        for i in layers:
            m_vs[i] = subspaces(head_dim, bits)
    if args.bits_v_mean is not None:
        widths = [mv for _, mv in cost_pairs(head_dim, m)]
        lo, hi = bits_of(head_dim, widths[0]), bits_of(head_dim, widths[-1])
        if not lo <= args.bits_v_mean <= hi:
            parser.error(f"--bits-v-mean {args.bits_v_mean:g}: with {given[0]} V can have "
                         f"{', '.join(f'{bits_of(head_dim, w):g}' for w in widths)} bits "
                         f"per layer, so a mean from {lo:g} to {hi:g}")
    if args.bits_mean is not None:
        means = sorted(pair_bits(head_dim, p) for p in cost_pairs(head_dim))
        if not means[0] <= args.bits_mean <= means[-1]:
            parser.error(f"--bits-mean {args.bits_mean:g}: layers can have "
                         f"{', '.join(f'{b:g}' for b in means)} bits per element, so a mean "
                         f"from {means[0]:g} to {means[-1]:g}")
    for mv in sorted(set(m_vs)):
        if (m, mv) not in supported_m(head_dim):
            parser.error(f"{' '.join(given)} asks for {describe_m(head_dim, m, mv)}"
                         + ("" if mv == m_v else " in some layers (--bits-v-layers)")
                         + f", which is not built; head_dim {head_dim} supports "
                         f"{supported_m_text(head_dim)}")
    return m, m_vs[0] if len(set(m_vs)) == 1 else m_v, m_vs


def cost_pairs(head_dim: int, m_k: int | None = None) -> list[tuple[int, int]]:
    """(Mk, Mv) pairs the kernels are built for, those with K's ``m_k`` where given:
    what calibration chooses among by cost, fewest bits first."""
    return sorted(((mk, mv) for mk, mv in supported_m(head_dim) if m_k in (None, mk)),
                  key=lambda p: (pair_bits(head_dim, p), p))


def pair_bits(head_dim: int, pair: tuple[int, int]) -> float:
    """Bits per element of K and V together at (Mk, Mv)."""
    return (bits_of(head_dim, pair[0]) + bits_of(head_dim, pair[1])) / 2


def allocate_pairs(k_costs: list[dict], v_costs: list[dict], pairs: list[tuple], mean: float
                   ) -> list[tuple]:
    """Each layer's (K bits, V bits) among ``pairs`` so that the layers' mean of (K + V) / 2
    is at most ``mean`` and the summed cost of their K and V (``k_costs``, ``v_costs``: per
    layer, bits -> cost) is least: allocate_bits over the pairs' means, which differ."""
    by_mean = {(bk + bv) / 2: (bk, bv) for bk, bv in pairs}
    assert len(by_mean) == len(pairs), pairs
    chosen = allocate_bits([{b: ck[bk] + cv[bv] for b, (bk, bv) in by_mean.items()}
                            for ck, cv in zip(k_costs, v_costs)], mean)
    return [by_mean[b] for b in chosen]


def choose_bits(stats, d: int, pairs: list[tuple[int, int]], mean: float, method_at,
                seed: int, device, progress: bool = True):
    """Each layer's (Mk, Mv) among ``pairs`` for ``--bits-mean`` (``--bits-v-mean``: the
    pairs with K's width): K and V trained at every width the pairs have, each one's cost
    to the loss measured (coding_cost), the cheapest choice for a mean of at most ``mean``
    bits per element (allocate_pairs). Returns each layer's pair, the costs of K and of V by
    layer and bits, and each layer's chosen (K, V) as trained (for train's parts)."""
    from tqdm import tqdm

    # K's training settings do not depend on V's bits: any width's method trains it
    methods = {"k": lambda m: method_at(pairs[-1][1]), "v": method_at}
    costs, trained = {"k": [], "v": []}, []
    for st in tqdm(stats, desc="K's and V's cost by layer and bits", unit="layer",
                   disable=not progress):
        parts = {}
        with st.held_on(device):
            for part, widths in (("k", {mk for mk, _ in pairs}), ("v", {mv for _, mv in pairs})):
                parts[part] = {m: _train_part(st, part, m, methods[part](m), seed, device)
                               for m in sorted(widths)}
                costs[part].append({bits_of(d, m): coding_cost(st, part, c, t, device)
                                    for m, (c, t, _) in parts[part].items()})
        trained.append(parts)
    chosen = [(subspaces(d, bk), subspaces(d, bv)) for bk, bv in allocate_pairs(
        costs["k"], costs["v"], [(bits_of(d, mk), bits_of(d, mv)) for mk, mv in pairs], mean)]
    return chosen, costs, [(parts["k"][mk], parts["v"][mv])
                           for parts, (mk, mv) in zip(trained, chosen)]


# With the loss's backward pass (--bits-v-mean, --bits-mean), its layers recomputed, the
# capture takes about four times as long (SmolLM2-135M on a CPU, two 2048-token
# sequences: 18.8 s forward, 77.5 s forward and backward; 69.0 s without recomputing the
# layers, at a peak of 3.0 GB of process memory against 1.8 GB).
BACKWARD_FACTOR = 4


def cpu_warning(params: int, tokens: int, backward: bool = False) -> str:
    """One line: calibration on the CPU is slow, about how slow, and how to pick a GPU."""
    seconds = params * tokens / CPU_PARAM_TOKENS_PER_S * (BACKWARD_FACTOR if backward else 1)
    minutes = round(seconds / 60)
    took = ("under a minute" if seconds < 60 else
            f"about {minutes} minute{'s' if minutes > 1 else ''}" if seconds < 5400 else
            f"about {seconds / 3600:.1f} hours")
    size = (f"{params / 1e9:.1f}B" if params >= 1e9 else
            f"{params / 1e6:.0f}M" if params >= 1e7 else f"{params / 1e6:.2f}M")
    return (f"calibrate: warning: running on the CPU: {took} for {size} parameters x {tokens} "
            f"tokens{', forward and backward' if backward else ''} (SmolLM2-135M x 65536: 40 "
            f"minutes forward, 30 s on an H100); give --device cuda "
            f"(or cuda:N) to run on a GPU"
            + ("" if torch.cuda.device_count() else " (torch sees none here)"))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _loading(path: str, what: str):
    """transformers' errors on a model folder, as one line."""
    try:
        yield
    except (OSError, ValueError, KeyError) as e:
        raise CalibrationError(f"--model {path}: cannot load its {what} with transformers "
                               f"({_first_line(e)})") from None


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    with _loading(path, "tokenizer"):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_weights(path: str, dtype: str, device: str):
    """(config, model) from a local model folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with _loading(path, "weights"):
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype))
    return cfg, model.to(device).eval()


def load_model(path: str, dtype: str, device: str):
    """(config, tokenizer, model) from a local model folder."""
    tok = load_tokenizer(path)
    cfg, model = load_weights(path, dtype, device)
    return cfg, tok, model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        return _run(args, parser)
    except CalibrationError as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2


def _run(args, parser) -> int:
    t0 = time.time()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise CalibrationError(f"--model {args.model}: no config.json there; give a local "
                               "Hugging Face model folder (README: eval/prepare.py makes one)")
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(args.model, local_files_only=True)
        d = head_dim_of(hf)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CalibrationError(f"--model {args.model}: its config.json is not a transformers "
                               f"model config ({_first_line(e)})") from None
    m, m_v, m_vs = _subspaces(parser, args, d, hf.get_text_config().num_hidden_layers)
    overrides = _overrides(parser, args.method)

    def method_at(mv: int) -> Method:  # V's metric depends on its bits (default_method)
        method = default_method(bits_of(d, mv), args.niter)
        if args.plain:
            method = Method(k_gamma=0, k_rotate=False, v_rotate=False, v_alpha=0,
                            niter=args.niter)
        return replace(method, **overrides)

    m_ks = [m] * len(m_vs)
    if args.bits_mean is not None:  # K's and V's bits by cost
        pairs, mean = cost_pairs(d), args.bits_mean
        what = f"K's and V's bits by layer for a mean of {mean:g} per element"
    elif args.bits_v_mean is not None:  # V's by cost, K's as given
        pairs, mean = cost_pairs(d, m), (bits_of(d, m) + args.bits_v_mean) / 2
        what = (f"K {bits_of(d, m):g} bits per element, V's bits by layer for a mean of "
                f"{args.bits_v_mean:g}")
    else:
        pairs, what = None, describe_layers_m(d, m_ks, m_vs)
    by_cost = pairs is not None

    context = getattr(hf.get_text_config(), "max_position_embeddings", None)
    if args.window is None:  # the window serving picks for this model at its default block
        args.window = default_window(DEFAULT_BLOCK_SIZE,
                                     getattr(hf.get_text_config(), "sliding_window", None))
    # keys are coded after RoPE: codebooks serve the positions their sequences reached
    lengths = sorted(set(args.seq_len or [max(MIN_TOKENS, min(context or DEFAULT_SEQ_LEN,
                                                                  args.tokens))]))
    seq_len = lengths[-1]
    docs = read_documents(args.text)
    tok = load_tokenizer(args.model)
    seqs = mix_lengths(token_sequences(tok, docs, seq_len, args.tokens,
                                       args.seed if args.shuffle_docs else None, args.pack),
                       lengths, tok.bos_token_id)
    total = sum(map(len, seqs))
    if total < NUM_CENTROIDS:
        raise CalibrationError(f"{' '.join(args.text)} gives {total} tokens in sequences of "
                               f"{MIN_TOKENS} or more; k-means needs {NUM_CENTROIDS}")
    longest = max(map(len, seqs))
    if context and longest < context:
        # keys are coded after RoPE: past the positions calibration saw they rotate where
        # the codebooks have no centroids, and the error grows with distance
        print(f"calibrate: warning: the longest sequence is {longest} tokens of the model's "
              f"{context}; served past position {longest}, these codebooks lose accuracy "
              f"with distance (docs/results.md, long context). For long contexts give "
              f"--seq-len N and --tokens of at least N, N the longest context you serve, on "
              f"packed text (the default)", file=sys.stderr)
    cfg, model = load_weights(args.model, args.dtype, args.device)
    print(f"calibration: {docs.count} documents, {len(seqs)} sequences, {total} tokens, "
          f"{what}, device {args.device}", flush=True)
    backward = by_cost or any(method_at(mv).fisher for mv in set(m_vs))
    cost_seqs = cost_sequences(seqs, args.window, args.seed) if args.fit_k == "measured" else []
    if torch.device(args.device).type == "cpu":  # the fit's passes are forward passes too
        print(cpu_warning(sum(p.numel() for p in model.parameters()), total + len(K_FITS) * len(
            m_vs) * sum(map(len, cost_seqs)), backward), file=sys.stderr, flush=True)
    if min(args.samples, total) < 39 * NUM_CENTROIDS:
        print(f"calibrate: warning: {min(args.samples, total)} samples per head is few for 256 "
              f"centroids; k-means wants at least {39 * NUM_CENTROIDS}", file=sys.stderr)
    stats = capture(model, tok, seqs, min(1.0, args.samples / total), args.seed, args.window,
                    args.device, fisher=backward)
    samples = int(sum(x.shape[0] for x in stats[0].k))
    if samples < NUM_CENTROIDS:  # rows kept per sequence are rounded
        raise CalibrationError(f"{samples} samples per head kept; k-means needs "
                               f"{NUM_CENTROIDS}: raise --samples")
    costs = parts = None
    if by_cost:
        chosen, costs, parts = choose_bits(stats, d, pairs, mean, method_at, args.seed,
                                           args.device)
        m_ks, m_vs = [mk for mk, _ in chosen], [mv for _, mv in chosen]
        m, m_v = base_m(m_ks), base_m(m_vs)
        what = describe_layers_m(d, m_ks, m_vs)
        print(f"bits chosen by cost: {what}", flush=True)
    k_fit = None
    if args.fit_k == "measured":
        k_parts, names, k_costs = fit_k(stats, model.float(), cost_seqs, m_ks, method_at(m_v),
                                        args.seed, args.window, args.device)
        parts = [(kp, vp) for kp, (_, vp) in zip(k_parts, parts or [(None, None)] * len(k_parts))]
        k_fit = {"candidates": K_FITS, "chosen": names,
                 "kl": [{n: float(f"{c:.6g}") for n, c in layer.items()} for layer in k_costs]}
        print("K's training by layer: " + ", ".join(
            f"{n} {names.count(n)}" for n in K_FITS if n in names), flush=True)
    del model
    out = args.out or default_codebook_path(args.model, m, m_v, m_vs, m_ks)
    method = method_at(m_v)
    books = train(stats, m_ks, m_vs, [method_at(mv) for mv in m_vs], args.seed, args.device,
                  parts=parts)
    save_codebooks(out, books["k"], books["v"], cfg, {
        "model": os.path.abspath(args.model),
        "texts": [os.path.abspath(t) for t in args.text],
        "documents": docs.count, "tokens": total, "seq_len": seq_len, "model_context": context, "samples_per_head": samples,
        **({"seq_lens": lengths} if len(lengths) > 1 else {}),
        "seed": args.seed, "dtype": args.dtype, "window": args.window,
        "shuffle_docs": args.shuffle_docs, "pack": args.pack,
        "method": asdict(method), "pinned_bos_sink": stats[0].sink is not None,
        **({"bits_k_layers": {str(bits_of(d, mk)): runs for mk, runs in other_k.items()}}
           if (other_k := layers_of_m(m_ks, m)) else {}),
        **({"bits_v_layers": {str(bits_of(d, mv)): runs for mv, runs in other.items()},
            "methods_v_layers": {str(bits_of(d, mv)): asdict(method_at(mv)) for mv in other}}
           if (other := layers_of_m(m_vs, m_v)) else {}),
        **({"bits_mean": args.bits_mean} if args.bits_mean is not None else {}),
        **({"bits_v_mean": args.bits_v_mean} if args.bits_v_mean is not None else {}),
        **({"k_fit": k_fit} if k_fit else {}),
        **({f"{part}_cost": [{f"{b:g}": float(f"{c:.6g}") for b, c in layer.items()}
                             for layer in costs[part]] for part in costs} if costs else {}),
        "rel_mse_k": books["rel_mse_k"], "rel_mse_v": books["rel_mse_v"],
        "seconds": round(time.time() - t0, 1),
    }, k_transform=books["k_transform"], v_transform=books["v_transform"])
    mk, mv = (sum(books[x]) / len(books[x]) for x in ("rel_mse_k", "rel_mse_v"))
    print(f"wrote {out}: {cfg.num_hidden_layers} layers x {books['k'][0].shape[0]} KV heads, "
          f"{what}, {samples} samples per head, mean relative error K {mk:.4f} V {mv:.4f} "
          f"(in the trained metric; {time.time() - t0:.0f} s)")
    print(codebook_path_hint(out, args.model, m, m_v, d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
