"""AdaMTP entropy segmentation (Cui et al. 2026): mask the draft targets that cross a semantic boundary.

The frozen backbone's predictive entropy H_t marks where the text changes course: a sharp rise means
the next token starts something the context does not determine. AdaMTP cuts the sequence there and
trains head j at position t only when its target x_{t+1+j} lies in the same segment as x_{t+1}, the
token the backbone itself produces at t.

    H_t      = -sum_v p_t(v) log p_t(v)                        entropy(logits)
    b_t      = True: a boundary before position t               boundaries(H, rule=...)
    g(t)     = #{s <= t : b_s}                                  group_ids(b)
    m_{t,j}  = g(t+1) == g(t+1+j), False when t+1+j >= T        adamtp_mask(g, k)
    d_t      = max{j : m_{t,j}} (0 if none)                      segment_depth(m)

Boundary rules:
- "diff" (the paper's): H_t - H_{t-1} > theta, for t >= 1.
- "zscore" (our own reading of "a sliding-window alternative", not from the paper): H_t lies more
  than z_threshold population standard deviations above the mean of the previous `window`
  entropies; see `boundaries` for the exact rule, including a flat window (std 0).

Padding: `valid` (B, T) bool marks real tokens. A padding position is never a boundary and never
enters the z-score statistics; under "diff" a position whose predecessor is padding is not a
boundary either (after left padding the first real token is treated like t = 0). The mask itself
ignores padding targets: AND it with the loss's own target mask.

Shape contract (B batch, T time, k draft depths, V vocab); head j (index j-1) at position t predicts
token t+1+j, the backbone predicts t+1. Everything here is pure tensor code: no Lightning, no Hydra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "RULES",
    "adamtp_mask",
    "adamtp_mask_from_entropy",
    "boundaries",
    "entropy",
    "group_ids",
    "make_adamtp_mask",
    "masked_fraction",
    "segment_depth",
]

RULES = ("diff", "zscore")

# Elements of one float32 temporary in `entropy` (64 MiB); a few such temporaries live at once.
_ENTROPY_CHUNK_ELEMS = 1 << 24
# A flat z-score window (std 0) still needs H_t to exceed its mean by this much (nats).
_ZSCORE_EPS = 1e-6


def _check_valid(valid: torch.Tensor | None, shape: torch.Size, name: str = "valid") -> None:
    if valid is None:
        return
    if valid.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {valid.dtype}")
    if valid.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(valid.shape)}")


# ---------------------------------------------------------------------------------------------------
# entropy


def entropy(logits: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Predictive entropy of the backbone, (B, T, V) -> (B, T) float32, in nats.

    Computed with log_softmax in float32 whatever the input dtype. Rows (b, t) are processed in
    chunks of `chunk_rows` so that only a chunk's float32 copy of the vocabulary axis exists at once
    (default: about 2**24 elements per chunk, 341 rows at V = 49,152). -inf logits (p = 0) add 0.
    Differentiable; `make_adamtp_mask` calls it under no_grad.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    B, T, V = logits.shape
    rows = logits.reshape(B * T, V)  # (B*T, V), a view when contiguous
    if chunk_rows is None:
        chunk_rows = max(1, _ENTROPY_CHUNK_ELEMS // max(V, 1))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out = []
    for start in range(0, B * T, chunk_rows):
        x = rows[start:start + chunk_rows].float()  # (n, V)
        logp = F.log_softmax(x, dim=-1)  # (n, V)
        p = logp.exp()  # (n, V)
        # p * logp is 0 * -inf = nan where p == 0; those terms are 0 by definition.
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))  # (n, V)
        out.append(-plogp.sum(dim=-1))  # (n,)
    if not out:
        return logits.new_zeros((B, T), dtype=torch.float32)
    return torch.cat(out).reshape(B, T)  # (B, T)


# ---------------------------------------------------------------------------------------------------
# boundaries and groups


def _diff_boundaries(H: torch.Tensor, theta: float, valid: torch.Tensor | None) -> torch.Tensor:
    b = torch.zeros_like(H, dtype=torch.bool)  # (B, T)
    b[:, 1:] = (H[:, 1:] - H[:, :-1]) > theta  # (B, T-1)
    if valid is not None:
        b[:, 1:] &= valid[:, 1:] & valid[:, :-1]  # both ends of the jump must be real tokens
    return b


def _zscore_boundaries(H: torch.Tensor, window: int, z_threshold: float,
                       valid: torch.Tensor | None) -> torch.Tensor:
    B, T = H.shape
    v = torch.ones_like(H, dtype=torch.bool) if valid is None else valid  # (B, T)
    # Left-pad by `window` so that window t of the unfold covers positions t-window .. t-1.
    Hp = F.pad(H, (window, 0))  # (B, T+window)
    vp = F.pad(v, (window, 0), value=False)  # (B, T+window)
    vw = vp.unfold(1, window, 1)[:, :T]  # (B, T, window) True where a previous value counts
    # `where`, not a product, so a non-finite entropy at a padding position cannot leak in.
    hw = torch.where(vw, Hp.unfold(1, window, 1)[:, :T], 0.0)  # (B, T, window)
    n = vw.sum(dim=-1)  # (B, T) long
    n_safe = n.clamp(min=1).to(H.dtype)  # (B, T)
    mean = hw.sum(dim=-1) / n_safe  # (B, T)
    dev2 = torch.where(vw, (hw - mean.unsqueeze(-1)) ** 2, 0.0)  # (B, T, window)
    var = dev2.sum(dim=-1) / n_safe  # (B, T) population variance
    std = var.sqrt()  # (B, T)
    excess = H - mean  # (B, T)
    b = (n >= 2) & (excess > torch.clamp(z_threshold * std, min=_ZSCORE_EPS))  # (B, T)
    return b & v


def boundaries(H: torch.Tensor, rule: str = "diff", theta: float = 1.0, window: int = 16,
               z_threshold: float = 2.0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Segment boundaries from entropies, (B, T) -> (B, T) bool; True at t = a boundary before t.

    rule "diff":   H_t - H_{t-1} > theta (strict), t >= 1; t = 0 is never a boundary. With `valid`,
                   both t and t-1 must be real tokens.
    rule "zscore": with S = the real-token entropies among positions max(0, t-window) .. t-1,
                   a boundary iff |S| >= 2 and H_t - mean(S) > max(z_threshold * std(S), 1e-6),
                   std being the population std. The 1e-6 floor means a flat window (std 0) makes
                   any rise above its mean a boundary (an infinite z-score) and equality never is.
    valid (B, T) bool, optional: padding positions are never boundaries and are left out of the
    z-score statistics (the window is still `window` positions wide, so it holds fewer values).
    """
    if H.dim() != 2:
        raise ValueError(f"H must be (B, T), got shape {tuple(H.shape)}")
    _check_valid(valid, H.shape)
    Hf = H.to(torch.promote_types(H.dtype, torch.float32))  # (B, T)
    if rule == "diff":
        return _diff_boundaries(Hf, theta, valid)
    if rule == "zscore":
        if window < 2:
            raise ValueError(f"window must be >= 2 for rule 'zscore', got {window}")
        if z_threshold < 0:
            raise ValueError(f"z_threshold must be >= 0, got {z_threshold}")
        return _zscore_boundaries(Hf, window, z_threshold, valid)
    raise ValueError(f"unknown boundary rule {rule!r}; expected one of {RULES}")


def group_ids(boundaries: torch.Tensor) -> torch.Tensor:
    """Segment id g(t) = number of boundaries at positions <= t, (B, T) bool -> (B, T) long."""
    if boundaries.dim() != 2:
        raise ValueError(f"boundaries must be (B, T), got shape {tuple(boundaries.shape)}")
    if boundaries.dtype != torch.bool:
        raise TypeError(f"boundaries must be a bool tensor, got {boundaries.dtype}")
    return boundaries.long().cumsum(dim=1)  # (B, T)


# ---------------------------------------------------------------------------------------------------
# mask and its summaries


def adamtp_mask(group_ids: torch.Tensor, k: int) -> torch.Tensor:
    """AdaMTP target mask, (B, T) long -> (B, T, k) bool.

    m[:, t, j-1] = g(t+1) == g(t+1+j): head j's target is in the segment of the backbone's own token.
    False where t+1+j >= T (no target). Because g never decreases, m is monotone in j: once a
    boundary lies between t+1 and t+1+j it lies there for every deeper head too, so each row is a
    run of True followed by False.
    """
    if group_ids.dim() != 2:
        raise ValueError(f"group_ids must be (B, T), got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    B, T = group_ids.shape
    m = torch.zeros((B, T, k), dtype=torch.bool, device=group_ids.device)  # (B, T, k)
    for j in range(1, k + 1):
        n = T - 1 - j  # positions t = 0 .. n-1 have a target t+1+j < T
        if n <= 0:
            break
        m[:, :n, j - 1] = group_ids[:, 1:1 + n] == group_ids[:, 1 + j:]  # (B, n)
    return m


def segment_depth(mask: torch.Tensor) -> torch.Tensor:
    """d_t = max{j : m[t, j-1]} (0 if none), (B, T, k) bool -> (B, T) long.

    For an AdaMTP mask (monotone in j) this equals mask.sum(-1); the max is taken explicitly so a mask
    ANDed with a non-monotone padding mask still gives the deepest kept head.
    """
    if mask.dim() != 3:
        raise ValueError(f"mask must be (B, T, k), got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape[:2], dtype=torch.long, device=mask.device)  # (B, T)
    depths = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # (k,)
    return (mask.long() * depths).amax(dim=-1)  # (B, T)


def masked_fraction(mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-depth fraction of existing targets that the AdaMTP mask drops, -> (k,) float32.

    mask, valid: (B, T, k) bool; valid marks targets that exist at all (in range, not padding).
    fraction_j = #(valid & ~mask at depth j) / #(valid at depth j), and 0 where no target is valid.
    """
    if mask.dim() != 3:
        raise ValueError(f"mask must be (B, T, k), got shape {tuple(mask.shape)}")
    _check_valid(valid, mask.shape)
    dropped = (valid & ~mask).sum(dim=(0, 1)).float()  # (k,)
    total = valid.sum(dim=(0, 1)).float()  # (k,)
    return torch.where(total > 0, dropped / total.clamp(min=1), torch.zeros_like(total))  # (k,)


def make_adamtp_mask(backbone_logits: torch.Tensor, k: int, rule: str = "diff", theta: float = 1.0,
                     window: int = 16, z_threshold: float = 2.0,
                     valid_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Backbone logits (B, T, V) -> AdaMTP mask (B, T, k) bool: entropy, boundaries, groups, mask.

    valid_tokens (B, T) bool marks real tokens (see `boundaries`). Runs under no_grad: the mask is a
    constant of the loss. Padding targets are not masked here; AND with the loss's target mask.
    """
    with torch.no_grad():
        return adamtp_mask_from_entropy(entropy(backbone_logits), k, rule, theta, window, z_threshold,
                                        valid_tokens)


def adamtp_mask_from_entropy(H: torch.Tensor, k: int, rule: str = "diff", theta: float = 1.0,
                             window: int = 16, z_threshold: float = 2.0,
                             valid_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`make_adamtp_mask` from a precomputed entropy H (B, T) (the cache and `teacher.backbone_stats`
    keep it, so training never needs the full-vocabulary logits for the mask)."""
    with torch.no_grad():
        b = boundaries(H, rule=rule, theta=theta, window=window, z_threshold=z_threshold,
                       valid=valid_tokens)  # (B, T)
        return adamtp_mask(group_ids(b), k)  # (B, T, k)
