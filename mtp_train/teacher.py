"""What the losses need from the frozen backbone, in a form that never needs the full vocabulary twice.

Per position t the backbone's distribution p_t = softmax(W h_t) is summed up by three numbers:
    lse_t      log sum_v exp(W h_t)_v          (normalises any subset of the logits)
    top_t      argmax_v (W h_t)_v              (its greedy token: what verification accepts)
    entropy_t  -sum_v p_t(v) log p_t(v)        (AdaMTP boundaries)
`backbone_stats` computes them once from the full logits (live, or when the cache is built); after
that the teacher for a draft vocabulary D is log p_t(v) = (W_D h_t)_v - lse_t for v in D, a |D|-column
matmul instead of a V-column one. With D = the full vocabulary this is exactly log_softmax.
"""

from __future__ import annotations

import torch

# float32 elements of one chunk's temporaries (64 MiB); a few such temporaries live at once
_CHUNK_ELEMS = 1 << 24


@torch.no_grad()
def backbone_stats(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """(..., V) logits -> {"lse": (...) float32, "top": (...) long, "entropy": (...) float32}."""
    shape, V = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, V)  # (n, V)
    chunk = max(1, _CHUNK_ELEMS // max(V, 1))
    lse, top, ent = [], [], []
    for s in range(0, rows.shape[0], chunk):
        x = rows[s: s + chunk].float()  # (c, V)
        m, t = x.max(dim=-1)  # (c,) x 2: the max and the greedy token in one pass
        y = (x - m[:, None]).clamp_(min=torch.finfo(torch.float32).min)  # (c, V); -inf -> finite
        e = torch.exp(y)  # (c, V) unnormalised p
        z = e.sum(-1)  # (c,)
        # H = log z - sum_v p_v y_v, with p = e / z; the clamp keeps 0 * (-inf) out of the dot
        lse.append(m + torch.log(z))
        ent.append(torch.log(z) - torch.linalg.vecdot(e, y) / z)
        top.append(t)
    if not lse:
        z = logits.new_zeros(shape, dtype=torch.float32)
        return {"lse": z, "top": z.long(), "entropy": z.clone()}
    return {"lse": torch.cat(lse).reshape(shape), "top": torch.cat(top).reshape(shape),
            "entropy": torch.cat(ent).reshape(shape)}


def positions_ahead(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool selection -> (b (N, 1), pos (N, k)): for the n-th selected position t_n, the
    positions t_n + 1 .. t_n + k whose backbone distribution is depth j's teacher. Positions past the
    end repeat the last one; their targets are invalid (`depth_targets`) and must be masked."""
    b, t = rows.nonzero(as_tuple=True)  # (N,), (N,)
    T = rows.shape[1]
    pos = (t[:, None] + torch.arange(1, k + 1, device=t.device)).clamp(max=T - 1)  # (N, k)
    return b[:, None], pos


@torch.no_grad()
def teacher_log_probs(hidden: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, k: int,
                      weight: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Depth-aligned teacher log-probabilities over the columns of `weight`.

    hidden (B, T, d), lse (B, T), rows (B, T) bool, weight (V', d) the LM head's rows of the draft
    vocabulary (or all of it) -> (N, k, V') with entry [n, j-1] = log p_{t_n + j} on those columns.
    Each needed position is projected once, however many depths read it. `logits` (B, T, V'), when
    the caller already has them (live backbone, full vocabulary), replaces the projection.
    """
    B, T = rows.shape
    need = torch.zeros_like(rows)  # (B, T): positions some selected row reads as a teacher
    for j in range(1, k + 1):
        if j < T:
            need[:, j:] |= rows[:, : T - j]
    index = torch.full((B, T), -1, dtype=torch.long, device=rows.device)  # (B, T) -> row of `proj`
    index[need] = torch.arange(int(need.sum()), device=rows.device)
    if logits is not None:
        proj = logits[need].float()  # (M, V')
    else:
        proj = hidden[need].float() @ weight.float().T  # (M, V')
    proj = proj - lse[need].float()[:, None]  # (M, V') log-probabilities
    b, pos = positions_ahead(rows, k)  # (N, 1), (N, k)
    # a clamped past-the-end position may not be needed by anyone: -1 reads an arbitrary row, masked
    return proj[index[b, pos]]  # (N, k, V')


@torch.no_grad()
def stats_from_hidden(hidden: torch.Tensor, lm_head) -> dict[str, torch.Tensor]:
    """`backbone_stats` of lm_head(hidden) for hidden (..., d), computed over chunks of positions
    so that no (..., V) tensor exists at once (the cache build and distillation use this)."""
    shape = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])  # (n, d)
    chunk = max(1, _CHUNK_ELEMS // max(lm_head.weight.shape[0], 1))
    parts = [backbone_stats(lm_head(rows[s: s + chunk])) for s in range(0, rows.shape[0], chunk)]
    if not parts:
        return backbone_stats(hidden.new_zeros(*shape, 1))
    return {k: torch.cat([p[k] for p in parts]).reshape(shape) for k in parts[0]}


@torch.no_grad()
def tempered_log_norms(lse: torch.Tensor, temperatures, logits: torch.Tensor | None = None,
                       hidden: torch.Tensor | None = None, lm_head=None) -> torch.Tensor:
    """log sum_v p_t(v)^(1/T) over the full vocabulary, per temperature T and position: (n_T, ...) float32.

    Tempering p_t by T divides p_t(v)^(1/T) by this sum, which the teacher's log-probabilities on a
    draft vocabulary cannot give. From the logits (..., V), or from lm_head(hidden) (..., d) in chunks
    where there are none (the hidden-state cache); lse (...) is log sum_v exp(z_v), so the result is
    logsumexp(z / T) - lse / T, exactly 0 at T = 1 (no projection for that one).
    """
    src = logits if logits is not None else hidden
    rows = src.detach().reshape(-1, src.shape[-1])  # (n, V) or (n, d)
    lse = lse.reshape(-1).float()  # (n,)
    out = torch.zeros(len(temperatures), rows.shape[0], device=rows.device)  # (n_T, n)
    hot = [i for i, t in enumerate(temperatures) if t != 1.0]
    V = rows.shape[-1] if logits is not None else lm_head.weight.shape[0]
    chunk = max(1, _CHUNK_ELEMS // max(V, 1))
    for s in range(0, rows.shape[0] if hot else 0, chunk):
        z = (rows[s: s + chunk] if logits is not None else lm_head(rows[s: s + chunk])).float()  # (c, V)
        for i in hot:
            t = temperatures[i]
            out[i, s: s + chunk] = torch.logsumexp(z / t, dim=-1) - lse[s: s + chunk] / t
    return out.reshape(len(temperatures), *src.shape[:-1])
