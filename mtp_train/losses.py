"""Draft-head training losses: CE, KL, TV and end-to-end TV, all masked and weighted per depth.

- CE: the Medusa objective (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
  with Multiple Decoding Heads") and the DeepSeek-V3 MTP loss (DeepSeek-V3 technical report, 2.2):
  head j at position t is scored against the data token x_{t+1+j}.
- KL: distil the frozen backbone's own distribution p_{t+j} into head j, KL(p || q).
- TV and end-to-end TV (Bebop, Qwen team 2026): under speculative rejection sampling a draft from q
  is accepted with probability alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q). TV trains each depth on
  1 - alpha; end-to-end TV trains the chain, 1 - mean_j prod_{i<=j} alpha_i, which is the expected
  accepted length that decoding is paid for.

Shape contract (B batch, T time, k depths, V vocab):
    logits          (B, T, k, V)  head j (index j-1) at position t predicts token t+1+j
    teacher_logits  (B, T, k, V)  the backbone's logits at the target position of each depth, aligned
                                  by the caller; treated as a constant (detached here)
    targets         (B, T, k)     long token ids
    mask            (B, T, k)     bool or {0, 1} float; which positions and depths count
    depth_weights   k floats >= 0 lambda_j, default all ones

Every loss returns a `LossOutput`: per_depth[j] is the masked mean over (B, T) at depth j, and loss is
sum_j w_j per_depth[j] / sum_j w_j over the depths with at least one target in the batch (except
end-to-end TV, which pools all (t, j) pairs, see there).
A masked mean over nothing is exactly 0 and still differentiable (zero gradients, never NaN).
Arithmetic runs in at least float32 whatever the input dtype. Logits are expected to be finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp_train.choices import LOSS_NAMES

__all__ = [
    "LOSSES",
    "LossOutput",
    "acceptance",
    "ce_loss",
    "compute_loss",
    "e2e_tv_loss",
    "greedy_agreement",
    "kl_loss",
    "topk_loss",
    "tv_loss",
]


@dataclass
class LossOutput:
    loss: torch.Tensor  # () the scalar to backpropagate
    per_depth: torch.Tensor  # (k,) masked mean loss per depth
    alpha: torch.Tensor | None = None  # (k,) masked mean acceptance per depth (TV losses), detached


# ---------------------------------------------------------------------------------------------------
# helpers


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 -> fp32; fp32 and fp64 stay as they are (no copy for fp32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_logits(logits: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> None:
    if logits.dim() != 4:
        raise ValueError(f"logits must be (B, T, k, V), got shape {tuple(logits.shape)}")
    if teacher_logits is not None and teacher_logits.shape != logits.shape:
        raise ValueError(f"teacher_logits shape {tuple(teacher_logits.shape)} != logits shape "
                         f"{tuple(logits.shape)}")


def _prepare_mask(mask: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.shape != logits.shape[:3]:
        raise ValueError(f"mask must be (B, T, k) = {tuple(logits.shape[:3])}, got {tuple(mask.shape)}")
    return mask.to(device=logits.device, dtype=dtype)  # (B, T, k)


def _prepare_weights(depth_weights: Sequence[float] | torch.Tensor | None, k: int,
                     device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if depth_weights is None:
        return torch.ones(k, device=device, dtype=dtype)  # (k,)
    w = torch.as_tensor(depth_weights, dtype=dtype).to(device).reshape(-1)  # (k,)
    if w.numel() != k:
        raise ValueError(f"depth_weights has {w.numel()} entries, expected k={k}")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"depth_weights must be finite, >= 0 and not all zero, got {w.tolist()}")
    return w


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (num is 0 there too, so gradients are 0, not NaN)."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _masked_mean_per_depth(per_pos: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """per_pos, m (B, T, k) -> (k,). `where` keeps a non-finite value at a masked slot out of the sum."""
    num = torch.where(m != 0, m * per_pos, torch.zeros_like(per_pos)).sum(dim=(0, 1))  # (k,)
    return _safe_div(num, m.sum(dim=(0, 1)))  # (k,)


def _reduce(per_pos: torch.Tensor, mask: torch.Tensor, depth_weights, *,
            alpha: torch.Tensor | None = None) -> LossOutput:
    """Per-position loss (B, T, k) -> LossOutput with the depth-weighted mean of per-depth means."""
    m = _prepare_mask(mask, per_pos, per_pos.dtype)  # (B, T, k)
    w = _prepare_weights(depth_weights, per_pos.shape[-1], per_pos.device, per_pos.dtype)  # (k,)
    per_depth = _masked_mean_per_depth(per_pos, m)  # (k,)
    # a depth with no target in this batch (AdaMTP can mask a whole depth) takes no part in the
    # average; otherwise its zero would pull the loss down
    w = w * (m.sum(dim=(0, 1)) > 0).to(w.dtype)  # (k,)
    loss = (w * per_depth).sum() / w.sum().clamp_min(torch.finfo(w.dtype).tiny)  # ()
    alpha_d = None if alpha is None else _masked_mean_per_depth(alpha.detach(), m)  # (k,)
    return LossOutput(loss=loss, per_depth=per_depth, alpha=alpha_d)


# ---------------------------------------------------------------------------------------------------
# per-position quantities


def _teacher_log_probs(teacher_logits: torch.Tensor, dtype: torch.dtype, logprobs: bool) -> torch.Tensor:
    """The teacher's log p, detached: log_softmax of logits, or the given log-probabilities as they are.

    `logprobs=True` is for a draft vocabulary: the backbone's log-probabilities normalised over the
    full vocabulary and restricted to the draft tokens sum to less than 1, and must stay so (the
    mass outside is what a draft can never be accepted for)."""
    t = _upcast(teacher_logits.detach()).to(dtype)
    return t if logprobs else F.log_softmax(t, dim=-1)


def acceptance(logits: torch.Tensor, teacher_logits: torch.Tensor,
               teacher_logprobs: bool = False) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q), p = softmax(teacher) (detached), q = softmax(logits).

    (B, T, k, V) x 2 -> (B, T, k): the probability that a draft sampled from q survives rejection
    sampling against p. Differentiable in `logits` only. With `teacher_logprobs`, p = exp(teacher).
    """
    _check_logits(logits, teacher_logits)
    x = _upcast(logits)  # (B, T, k, V)
    with torch.no_grad():
        p = _teacher_log_probs(teacher_logits, x.dtype, teacher_logprobs).exp()  # (B, T, k, V)
    q = torch.softmax(x, dim=-1)  # (B, T, k, V)
    return torch.minimum(p, q).sum(dim=-1)  # (B, T, k)


def sampled_acceptance(logits: torch.Tensor, teacher_logprobs: torch.Tensor, temperature: float,
                       log_norm: torch.Tensor | None = None) -> torch.Tensor:
    """alpha at a temperature: sum_x min(p_T(x), q_T(x)), the chance that a draft drawn from the
    head's q_T = softmax(logits / T) (as the decoder draws at temperature T) survives speculative
    sampling against the backbone's p_T(x) = p(x)^(1/T) / sum_v p(v)^(1/T).

    (..., |D|) x 2 -> (...), teacher_logprobs = log p on the heads' vocabulary. log_norm (...) is
    log sum_v p(v)^(1/T) over the backbone's whole vocabulary (`teacher.tempered_log_norms`; 0 at
    T = 1); None when the heads' vocabulary is the whole one (then it is computed here)."""
    q = torch.softmax(_upcast(logits) / temperature, dim=-1)
    lp = teacher_logprobs.float() / temperature
    lp = lp - (torch.logsumexp(lp, dim=-1, keepdim=True) if log_norm is None else log_norm.float()[..., None])
    return torch.minimum(lp.exp(), q).sum(dim=-1)


def greedy_agreement(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """(B, T, k) bool: the head's argmax equals the backbone's argmax (greedy verification accepts)."""
    _check_logits(logits, teacher_logits)
    return logits.argmax(dim=-1) == teacher_logits.argmax(dim=-1)  # (B, T, k)


# ---------------------------------------------------------------------------------------------------
# losses


def ce_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
            depth_weights: Sequence[float] | None = None) -> LossOutput:
    """Token cross-entropy of head j against targets[..., j] (Medusa / DeepSeek-V3 MTP)."""
    _check_logits(logits)
    if targets.shape != logits.shape[:3]:
        raise ValueError(f"targets must be (B, T, k) = {tuple(logits.shape[:3])}, "
                         f"got {tuple(targets.shape)}")
    x = _upcast(logits)  # (B, T, k, V)
    # Masked slots may hold a padding id such as -100: point them at token 0 so gather stays in range.
    # An out-of-range id at a slot that counts still fails loudly in gather.
    idx = torch.where(mask.to(targets.device) != 0, targets, torch.zeros_like(targets))  # (B, T, k)
    # logsumexp - picked logit keeps only x for backward, unlike F.cross_entropy's saved log_softmax.
    lse = torch.logsumexp(x, dim=-1)  # (B, T, k)
    picked = x.gather(-1, idx.long().unsqueeze(-1)).squeeze(-1)  # (B, T, k)
    return _reduce(lse - picked, mask, depth_weights)


def kl_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
            depth_weights: Sequence[float] | None = None, teacher_logprobs: bool = False) -> LossOutput:
    """KL(p || q) with p = softmax(teacher) (detached), q = softmax(logits), from log-softmaxes.

    With `teacher_logprobs` and a p that sums to Z < 1 (a draft vocabulary), sum p log(p/q) is
    minimised at q = p / Z: the head learns the backbone's distribution renormalised to its vocabulary.
    """
    _check_logits(logits, teacher_logits)
    x = _upcast(logits)  # (B, T, k, V)
    with torch.no_grad():
        log_p = _teacher_log_probs(teacher_logits, x.dtype, teacher_logprobs)  # (B, T, k, V)
        p = log_p.exp()  # (B, T, k, V)
    log_q = F.log_softmax(x, dim=-1)  # (B, T, k, V)
    diff = log_p - log_q  # (B, T, k, V)
    del log_p  # one (B, T, k, V) buffer fewer before the product
    kl = (p * diff).sum(dim=-1)  # (B, T, k)
    return _reduce(kl, mask, depth_weights)


def backbone_distill_loss(logits: torch.Tensor, reference_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of KL(p_ref || p): keeps an adapted backbone's next-token
    distribution p = softmax(logits) close to the original's p_ref = softmax(reference_logits)
    (detached). (B, T, V) x 2, mask (B, T) -> a scalar; 0 when nothing is masked in."""
    if logits.shape != reference_logits.shape or mask.shape != logits.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)}, reference {tuple(reference_logits.shape)} and "
                         f"mask {tuple(mask.shape)} do not match")
    keep = mask.bool()
    if not keep.any():
        return logits.sum() * 0.0
    log_q = F.log_softmax(_upcast(logits[keep]), dim=-1)  # (N, V)
    with torch.no_grad():
        log_p = F.log_softmax(_upcast(reference_logits[keep].detach()), dim=-1)  # (N, V)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def tv_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
            depth_weights: Sequence[float] | None = None, teacher_logprobs: bool = False) -> LossOutput:
    """Per depth 1 - alpha = TV(p, q) (Bebop); also reports the masked mean alpha per depth."""
    alpha = acceptance(logits, teacher_logits, teacher_logprobs)  # (B, T, k)
    return _reduce(1.0 - alpha, mask, depth_weights, alpha=alpha)


def e2e_tv_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                depth_weights: Sequence[float] | None = None, teacher_logprobs: bool = False) -> LossOutput:
    """End-to-end TV (Bebop): reward the chance the whole chain up to depth j is accepted.

    A_{t,j} = prod_{i<=j} alpha_{t,i};  loss = 1 - sum_{t,j} m w_j A / sum_{t,j} m w_j.
    Unlike the other losses this pools every (t, j) pair, so a depth with few valid positions weighs
    less. With an all-ones mask and weights, loss = 1 - (E[accepted length] - 1) / k where
    E[accepted length] = 1 + sum_j A_j (the backbone's own token plus the accepted drafts).
    per_depth[j] = masked mean of 1 - A_{., j} (0 for a depth with no valid position);
    alpha[j] = masked mean of alpha_{., j}.
    """
    alpha = acceptance(logits, teacher_logits, teacher_logprobs)  # (B, T, k)
    chain = torch.cumprod(alpha, dim=-1)  # (B, T, k)
    m = _prepare_mask(mask, chain, chain.dtype)  # (B, T, k)
    w = _prepare_weights(depth_weights, chain.shape[-1], chain.device, chain.dtype)  # (k,)
    mw = m * w  # (B, T, k)
    # 1 - sum(mw A) / sum(mw) written as a mean of (1 - A), so an empty mask gives exactly 0.
    miss = 1.0 - chain  # (B, T, k)
    num = torch.where(mw != 0, mw * miss, torch.zeros_like(miss)).sum()  # ()
    loss = _safe_div(num, mw.sum())  # ()
    return LossOutput(loss=loss, per_depth=_masked_mean_per_depth(miss, m),
                      alpha=_masked_mean_per_depth(alpha.detach(), m))


def topk_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, topk: int,
              depth_weights: Sequence[float] | None = None, teacher_logprobs: bool = False) -> LossOutput:
    """Top-K distillation (HASS): cross-entropy of q against the teacher restricted to its K most
    likely tokens and renormalised there, -sum_{v in top_K(p)} p(v) / P_K log q(v), P_K = sum of
    those p(v). It spends the head's capacity on ordering the few tokens a draft tree can hold."""
    _check_logits(logits, teacher_logits)
    x = _upcast(logits)  # (B, T, k, V)
    with torch.no_grad():
        log_p = _teacher_log_probs(teacher_logits, x.dtype, teacher_logprobs)  # (B, T, k, V)
        top_lp, top_idx = log_p.topk(min(topk, log_p.shape[-1]), dim=-1)  # (B, T, k, K) x 2
        w = torch.softmax(top_lp, dim=-1)  # (B, T, k, K) p renormalised over the top K
    log_q = F.log_softmax(x, dim=-1).gather(-1, top_idx)  # (B, T, k, K)
    return _reduce(-(w * log_q).sum(-1), mask, depth_weights)


LOSSES = LOSS_NAMES


def compute_loss(name: str, logits: torch.Tensor, *, targets: torch.Tensor | None = None,
                 teacher_logits: torch.Tensor | None = None, mask: torch.Tensor,
                 depth_weights: Sequence[float] | None = None, teacher_logprobs: bool = False) -> LossOutput:
    """Dispatch on name in LOSSES; "ce" needs targets, the others need teacher_logits (logits, or
    log-probabilities with `teacher_logprobs=True`, see `_teacher_log_probs`)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(LOSSES)}")
    if name == "ce":
        if targets is None:
            raise ValueError("loss 'ce' needs targets")
        return ce_loss(logits, targets, mask, depth_weights)
    if teacher_logits is None:
        raise ValueError(f"loss {name!r} needs teacher_logits")
    fn = {"kl": kl_loss, "tv": tv_loss, "e2e_tv": e2e_tv_loss}[name]
    return fn(logits, teacher_logits, mask, depth_weights, teacher_logprobs)
