"""Weighted k-means for many subspaces at once, in PyTorch (GPU or CPU).

Why not faiss: the codebooks are trained with per-token weights (attention mass, see
calibrate.py), which faiss' ProductQuantizer cannot take, and faiss-gpu has no wheel for
this stack. A layer's subspaces (every KV head x M) are independent k-means problems of
the same size, so one batched matmul per chunk of points assigns all of them together:
a Llama-3-8B layer at 4 bits is 512 problems of 32K points, a few milliseconds an
iteration on a GPU.
"""

from __future__ import annotations

import torch

from .layout import NUM_CENTROIDS


def _chunk(s: int, k: int, device: torch.device) -> int:
    budget = (1 << 30) if device.type == "cuda" else (1 << 25)  # bytes of distances
    return max(256, budget // (4 * s * k))


def assign(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of every point: ``x [S, n, ds]``, ``c [S, k, ds]`` ->
    (index ``[S, n]`` int64, squared distance ``[S, n]``)."""
    s, n, _ = x.shape
    c2 = (c * c).sum(-1).unsqueeze(1)  # [S, 1, k]
    idx = torch.empty(s, n, dtype=torch.long, device=x.device)
    dist = torch.empty(s, n, dtype=x.dtype, device=x.device)
    step = _chunk(s, c.shape[1], x.device)
    for a in range(0, n, step):
        xs = x[:, a : a + step]
        d = torch.baddbmm(c2, xs, c.transpose(1, 2), alpha=-2.0)  # ||c||^2 - 2 x.c
        best, i = d.min(-1)
        idx[:, a : a + step] = i
        dist[:, a : a + step] = (best + (xs * xs).sum(-1)).clamp_min(0)
    return idx, dist


def kmeans(
    x: torch.Tensor,
    weights: torch.Tensor | None = None,
    k: int = NUM_CENTROIDS,
    niter: int = 25,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on ``x [S, n, ds]`` (float32), each of the S problems on its own,
    minimising sum_i w_i ||x_i - c(x_i)||^2 with ``weights [S, n]`` (None: all 1).

    Starts from k points drawn without replacement in proportion to their weights; a
    centroid left without points is moved to a point drawn in proportion to its weighted
    error (the points worst served), as k-means++ would seed it. Returns centroids
    ``[S, k, ds]`` and the weighted relative error per problem ``[S]``."""
    s, n, ds = x.shape
    if n < k:
        raise ValueError(f"k-means needs at least {k} points per subspace, got {n}")
    w = torch.ones(s, n, device=x.device) if weights is None else weights.float()
    gen = torch.Generator(device=x.device).manual_seed(seed)
    pick = torch.multinomial(w + 1e-12, k, replacement=False, generator=gen)  # [S, k]
    c = torch.gather(x, 1, pick.unsqueeze(-1).expand(-1, -1, ds)).clone()
    for _ in range(niter):
        idx, dist = assign(x, c)
        sums = torch.zeros(s, k, ds, device=x.device).scatter_add_(
            1, idx.unsqueeze(-1).expand(-1, -1, ds), x * w.unsqueeze(-1))
        mass = torch.zeros(s, k, device=x.device).scatter_add_(1, idx, w)
        filled = mass > 0
        c = torch.where(filled.unsqueeze(-1), sums / mass.clamp_min(1e-30).unsqueeze(-1), c)
        if not filled.all():
            empty = (~filled).nonzero()  # [e, 2]: (problem, centroid)
            worst = torch.multinomial(dist * w + 1e-12, k, replacement=False, generator=gen)
            c[empty[:, 0], empty[:, 1]] = x[empty[:, 0], worst[empty[:, 0], empty[:, 1]]]
    _, dist = assign(x, c)
    err = (dist * w).sum(1) / ((x * x).sum(-1) * w).sum(1).clamp_min(1e-30)
    return c, err
