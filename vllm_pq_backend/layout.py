"""The product-quantized KV page: the one definition of its bytes and of the window.

Each vLLM block of one layer is viewed by vLLM as ``[num_blocks, num_kv_heads, B, Mk+Mv]``
uint8 (``LBHNC``: a head's ``B * (Mk+Mv)`` bytes are contiguous). Inside one (block, KV
head) region we lay the bytes out ourselves::

    offset 0        K codes   [B][Mk]   a token's Mk codes contiguous (one vector load)
    offset B*Mk     V codes   [Mv][B]   transposed: one subspace's codes of all tokens
                                        contiguous, so threads owning the output
                                        dimensions of one subspace stream them

Codes are 8-bit indices into 256 centroids of the subspace's codebook, so K costs
8 Mk / head_dim bits per element and V 8 Mv / head_dim (``SUBSPACES`` lists the pairs the
kernels are built for). The CUDA kernels receive these numbers (``PageLayout.kernel_args``)
rather than restating them.

Residual window (full-precision recent tokens)
-----------------------------------------------
With window ``W > 0`` a query at position ``i`` reads key/value ``j <= i`` at full
precision iff ``j >= window_start(i) = (i // W) * W`` and through its codes otherwise.
``W`` divides the block size ``B``, so a window never starts inside a block that vLLM
could have shared through prefix caching: prefix hits are whole blocks, every full-
precision token a query needs was written by the same request in this life of it, and
prefill (any chunking), decode, batching, preemption and prefix caching on or off all
see exactly the same keys. Codes are written for every token, so shared blocks are
always readable. ``W = 0`` reads every key through its codes.

Exact store
-----------
With ``exact = P > 0`` each (block, KV head) region also holds, after the V codes, the
``P`` keys and the ``P`` values of the page whose codes err most (squared error relative
to the vector's, in the codebooks' mapped frame), as residuals ``x - decode(codes)`` in
the activation dtype, so that a reader adds them to what the codes give::

    offset B*(Mk+Mv)          K residuals [P][D]   16-bit
           + 2 P D            V residuals [P][D]
           + 4 P D            K errors [P], V errors [P]      float32
           + 4 P D + 8 P      K in-page indices [P], V's [P]  int32, -1: empty

Entries are sorted by error (largest first, the lower index on ties). The set is a
function of the page's tokens alone: a step's tokens of a page (a run of consecutive
positions) join the entries of the tokens before them, every entry at or after the run's
first position is dropped (a token written again replaces the old one), and a run that
starts the page starts from no entries, so chunking, prefix caching and recomputation
after preemption give the same set (exact.py, reference.exact_update). Only tokens whose
codes err (error > 0, finite) enter. The store needs ``W = B``: a query then reads through
codes only whole pages before its own, whose entries no later token changes, so that its
result does not depend on how the prompt was chunked. Under speculative decoding, a page
whose rejected drafts displaced entries keeps the survivors, not the best of its final
tokens: never a wrong vector, a few fewer exact ones. vLLM sizes the page by whole bytes
per token: ``ceil(P (4 D + 16) / B)`` more per token and KV head.

Non-finite keys and values
--------------------------
Code ``NAN_CODE`` of subspace 0 is reserved: the store writes it for a (token, KV head)
whose K (or V) holds a NaN or an infinity, and its centroid is NaN while serving
(``codebooks.nan_marked``), so every query that reads the token gets NaN, as with
FLASH_ATTN, instead of a plausible vector (the window keeps the values as they are).
Finite vectors never get it: a NaN centroid is never nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_CENTROIDS = 256  # 8-bit codes
NAN_CODE = 255  # subspace 0: the token's vector was not finite (see above)
BLOCK_ALIGN = 32  # the decode kernel consumes pages in 32-token chunks
HEAD_DIMS = (64, 128, 256)  # head sizes the kernels are built for
# (bits per element of K, of V) -> subspaces per head: 8-bit codes over head_dim / M dims
# are 8 M / head_dim bits per element. csrc/gen_units.py builds a decode kernel for each.
# A codebook file may give V other bits in some layers (codebooks.py): each layer's pair
# is one of these.
BIT_RATES = ((1, 1), (2, 2), (4, 4), (4, 2), (4, 1))
RESIDUAL_BYTES = 2  # exact store residuals: the activation dtype (bf16 or fp16)


def residual_dtype(dtype):
    """The exact store's residuals' dtype for activations of ``dtype``: the same, 16-bit as
    served; float32 (the reference path in tests) stores bfloat16."""
    import torch

    return dtype if dtype.itemsize == RESIDUAL_BYTES else torch.bfloat16


def subspaces(head_dim: int, bits: int) -> int:
    return bits * head_dim // 8


def bits_of(head_dim: int, m: int) -> float:
    """Bits per element of 8-bit codes over head_dim / m dims."""
    b = 8 * m / head_dim
    return int(b) if b == int(b) else b


def supported_m(head_dim: int) -> list[tuple[int, int]]:
    """(Mk, Mv) pairs the kernels are built for at this head size."""
    return [(subspaces(head_dim, bk), subspaces(head_dim, bv)) for bk, bv in BIT_RATES]


def window_start(pos, window: int):
    """First position read at full precision by a query at ``pos`` (int or tensor)."""
    if window <= 0:
        return pos + 1
    return (pos // window) * window


def window_row(row, pos, window: int, halves: int):
    """The window store row that holds position ``pos`` of the request given store row
    ``row`` (ints, numpy arrays or tensors). With ``halves`` 2 (speculative decoding) a
    request owns rows ``2 row`` and ``2 row + 1`` and consecutive window segments
    alternate between them: a verification step writes the first tokens of the next
    segment without overwriting the segment its rejected drafts fall back into."""
    return row * halves + (pos // window) % halves


@dataclass(frozen=True)
class PageLayout:
    block_size: int
    m_k: int  # K subspaces per head: bytes of K codes per token
    m_v: int  # V subspaces per head
    head_dim: int = 0  # needed with an exact store
    exact: int = 0  # exact store entries per page and KV head, of K and of V (see above)

    def __post_init__(self):
        if self.exact < 0 or (self.exact and self.head_dim <= 0):
            raise ValueError(f"exact store of {self.exact} entries needs exact >= 0 and the "
                             f"head size (got {self.head_dim})")

    @property
    def exact_bytes(self) -> int:
        return self.exact * (2 * RESIDUAL_BYTES * self.head_dim + 16)

    @property
    def state_bytes(self) -> int:
        """Bytes per (token, KV head): vLLM's ``state_content_bytes``."""
        return self.m_k + self.m_v + -(-self.exact_bytes // self.block_size)

    @property
    def exact_offset(self) -> int:
        return self.block_size * (self.m_k + self.m_v)

    def residual_offset(self, which: int) -> int:
        """Byte offset of the K (``which`` 0) or V (1) residuals in a region."""
        return self.exact_offset + which * self.exact * self.head_dim * RESIDUAL_BYTES

    def error_offset(self, which: int) -> int:
        return self.residual_offset(2) + 4 * which * self.exact

    def index_offset(self, which: int) -> int:
        return self.error_offset(2) + 4 * which * self.exact

    def bits(self) -> tuple[float, float]:
        """Bits per element of K and of V, the exact store's bytes shared between them."""
        extra = 8 * (self.state_bytes - self.m_k - self.m_v) / (2 * self.head_dim or 1)
        return 8 * self.m_k / self.head_dim + extra, 8 * self.m_v / self.head_dim + extra

    @property
    def head_bytes(self) -> int:
        return self.block_size * self.state_bytes

    @property
    def k_offset(self) -> int:
        return 0

    @property
    def v_offset(self) -> int:
        return self.block_size * self.m_k

    def k_code_offset(self, token, sub):
        """Byte offset of K code ``sub`` of ``token`` within a (block, head) region."""
        return self.k_offset + token * self.m_k + sub

    def v_code_offset(self, token, sub):
        return self.v_offset + sub * self.block_size + token

    def kernel_args(self) -> tuple[int, int, int, int, int]:
        """(k_offset, k_token_stride, v_offset, v_sub_stride, nan_code): the CUDA kernels'
        ``PageLayout`` (csrc/pq_kernels.h)."""
        return (self.k_offset, self.m_k, self.v_offset, self.block_size, NAN_CODE)
