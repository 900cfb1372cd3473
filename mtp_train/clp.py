"""Span-length predictors (CLP, Xie & Zhou 2026; docs/algorithms.md, "CLP"): how many head drafts to
commit after the backbone's own token, decided from the backbone's state without verification.

    clp   one linear layer: features -> k + 1 classes (m = 0..k drafts accepted). On the hidden state
          alone it has d(k+1) + (k+1) parameters: 4,611 for d=1536, k=2; 2,308 for SmolLM2 (d=576, k=3).
    gate  the ~1M-parameter MLP baseline ("gate network") on the same features.

Features are the backbone's final hidden state h_p, optionally concatenated with the k heads' top-1
probabilities. The decision rule is m = max{m : P(L >= m) >= threshold} with P(L >= m) the cumulative
class probability from m up; P(L >= 0) = 1, so m = 0 (only the backbone's token) whenever nothing
else clears the threshold, and a threshold of 1 accepts no draft. Pure torch, no decode loops:
fitting lives in lit/predictor.py and pipeline/clp_run.py, the threshold's calibration by decoding
in evaluation/calibration.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mtp_train.choices import PREDICTOR_KINDS
from mtp_train.errors import ConfigError, MtpError
from mtp_train.heads.persist import count_parameters
from mtp_train.layout import PREDICTOR_FILE, PREDICTOR_META


class SpanPredictor(nn.Module):
    def __init__(self, hidden_size: int, k: int, use_head_probs: bool = False):
        super().__init__()
        self.hidden_size, self.k, self.use_head_probs = hidden_size, k, use_head_probs
        self.in_features = hidden_size + (k if use_head_probs else 0)

    def features(self, hidden: torch.Tensor, head_probs: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., d), head_probs (..., k) -> (..., in_features)."""
        if not self.use_head_probs:
            return hidden
        if head_probs is None or head_probs.shape[-1] != self.k:
            raise ValueError(f"this predictor reads the {self.k} heads' top-1 probabilities")
        return torch.cat([hidden, head_probs.to(hidden.dtype)], -1)

    def forward(self, hidden: torch.Tensor, head_probs: torch.Tensor | None = None) -> torch.Tensor:
        """-> logits (..., k + 1) over the number of drafts to accept."""
        return self.net(self.features(hidden, head_probs))


class LinearCLP(SpanPredictor):
    def __init__(self, hidden_size: int, k: int, use_head_probs: bool = False):
        super().__init__(hidden_size, k, use_head_probs)
        self.net = nn.Linear(self.in_features, k + 1)


class GateMLP(SpanPredictor):
    """One hidden layer, sized to about `params` parameters (1M by default) for these inputs."""

    def __init__(self, hidden_size: int, k: int, use_head_probs: bool = False, params: int = 1_000_000):
        super().__init__(hidden_size, k, use_head_probs)
        width = max(8, round((params - (k + 1)) / (self.in_features + 1 + k + 1)))
        self.net = nn.Sequential(nn.Linear(self.in_features, width), nn.GELU(), nn.Linear(width, k + 1))


def build_predictor(kind: str, hidden_size: int, k: int, use_head_probs: bool = False) -> SpanPredictor:
    if kind not in PREDICTOR_KINDS:
        raise ConfigError(f"clp.kind: unknown value {kind!r}; choose one of {', '.join(PREDICTOR_KINDS)}")
    cls = LinearCLP if kind == "clp" else GateMLP
    return cls(hidden_size, k, use_head_probs)


def undo_class_weights(predictor: SpanPredictor, weights: torch.Tensor) -> None:
    """Turn a predictor fitted with class-weighted cross-entropy into one whose softmax estimates the
    label frequencies themselves, in place.

    Weighted CE is minimised by q(m | x) = w_m p(m | x) / sum_j w_j p(j | x): it overstates the rare
    long spans by their weight, so P(L >= m) read from q clears the threshold far more often than the drafts
    are right. Dividing by w_m and renormalising recovers p; a softmax does the renormalising, so
    subtracting log w_m from the last layer's bias is exact. Classes absent from the labels (w = 0)
    keep their bias: no label raised it."""
    last = predictor.net if isinstance(predictor.net, nn.Linear) else predictor.net[-1]
    w = weights.to(last.bias.dtype)
    with torch.no_grad():
        last.bias.sub_(torch.where(w > 0, w.clamp(min=1e-12).log(), torch.zeros_like(w)))


@torch.no_grad()
def held_out_calibration(predictor: SpanPredictor, hidden: torch.Tensor, head_probs: torch.Tensor,
                         labels: torch.Tensor) -> dict:
    """How well the predictor's probabilities match held-out labels: unweighted NLL and, for
    P(L >= 1), the mean predicted value beside the observed frequency."""
    logp = torch.log_softmax(predictor(hidden, head_probs).float(), -1)
    return {"val/nll": float(torch.nn.functional.nll_loss(logp, labels)),
            "val/p_span1_predicted": float(1 - logp[:, 0].exp().mean()),
            "val/p_span1_observed": float((labels >= 1).float().mean())}


def check_predictor_weights(meta: dict, weights: Path) -> None:
    """predictor.safetensors is the file mtp-clp wrote (its sha256 in predictor.json; predictors
    from before that record are not checked)."""
    from mtp_train.artifacts import file_sha256

    want = meta.get("weights_sha256")
    if want is not None and file_sha256(weights) != want:
        raise MtpError(f"{weights}: not the weights mtp-clp fitted (its sha256 differs from the one "
                       f"{PREDICTOR_META} records: damaged, edited or copied from another run); rerun "
                       "`mtp-clp stage=fit` (and calibrate)")


def calibration_seal(meta: dict) -> str:
    """A digest over what calibration decided and for which weights and settings: a threshold edited
    by hand (eval.span_threshold is the way to try another) no longer passes as calibrated."""
    from mtp_train.artifacts import config_hash

    return config_hash({k: meta.get(k) for k in ("threshold", "calibrated", "calibration_hash", "weights_sha256")})


def saved_threshold(meta: dict, where="predictor.json") -> float | None:
    """The calibrated threshold a predictor's predictor.json holds (None: not calibrated yet), held to
    the rule clp.thresholds and eval.span_threshold are held to on the command line: a number in (0, 1],
    and to the seal calibration wrote beside it."""
    value = meta.get("threshold")
    if value is None:
        return None
    if meta.get("seal") is not None and meta["seal"] != calibration_seal(meta):
        raise MtpError(f"{where}: the threshold or its calibration record was changed after mtp-clp calibrated it "
                       f"(threshold {value!r}); rerun `mtp-clp stage=calibrate`, or try a threshold with "
                       "eval.span_threshold")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise MtpError(f"{where}: threshold {value!r} is not a probability in (0, 1]; the file was edited or "
                       "damaged: rerun `mtp-clp stage=calibrate`")
    return float(value)


def span_from_probs(probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Class probabilities (..., k + 1) -> m = max{m : P(L >= m) >= threshold} (..., ) long."""
    tail = probs.flip(-1).cumsum(-1).flip(-1)  # (..., k+1): P(L >= m)
    ok = tail >= threshold - 1e-7  # (..., k+1)
    ok[..., 0] = True  # P(L >= 0) = 1
    idx = torch.arange(probs.shape[-1], device=probs.device)
    return torch.where(ok, idx, torch.zeros_like(idx)).max(-1).values


def class_weights(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse-frequency weights (k + 1,), mean 1 over the classes present; absent classes get 0."""
    counts = torch.bincount(labels.long().flatten(), minlength=k + 1)[: k + 1].float()
    present = counts > 0
    w = torch.where(present, counts.sum() / counts.clamp(min=1), torch.zeros_like(counts))
    return w * present.sum() / w.sum().clamp(min=1e-12)


class SpanPolicy:
    """The decoder's `span_policy` for mode clp: callable(hidden (d,), head_probs (k,)) -> m."""

    def __init__(self, predictor: SpanPredictor, threshold: float):
        self.predictor, self.threshold = predictor.eval(), threshold
        self.needs_probs = predictor.use_head_probs  # False: the decoder asks before drafting

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, head_probs: torch.Tensor | None = None) -> int:
        logits = self.predictor(hidden.float(), None if head_probs is None else head_probs.float())
        return int(span_from_probs(torch.softmax(logits, -1), self.threshold))


def save_predictor(out_dir: Path, predictor: SpanPredictor, meta: dict) -> Path:
    """predictor.safetensors (weights) + predictor.json (kind, k, d, inputs, backbone, threshold, figures); atomic."""
    import os

    from safetensors.torch import save_file

    from mtp_train.artifacts import check_finite, write_json_atomic

    out_dir = Path(out_dir)
    state = {n: t.detach().contiguous() for n, t in predictor.state_dict().items()}
    check_finite(state, f"{out_dir / PREDICTOR_FILE}: not written, the fit diverged")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (PREDICTOR_FILE + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, out_dir / PREDICTOR_FILE)
    from mtp_train.artifacts import file_sha256

    write_json_atomic(out_dir / PREDICTOR_META, {
        **meta, "kind": "clp" if isinstance(predictor, LinearCLP) else "gate", "k": predictor.k,
        # loading checks the file against it: damaged, edited or swapped weights are refused
        "weights_sha256": file_sha256(out_dir / PREDICTOR_FILE),
        "hidden_size": predictor.hidden_size, "use_head_probs": predictor.use_head_probs,
        "parameters": count_parameters(predictor)["total"]})
    return out_dir / PREDICTOR_FILE


def predictor_mismatch(meta: dict, kind: str | None, hidden_size: int | None, k: int | None) -> str | None:
    """Why a predictor.json cannot serve as a `kind` predictor (None: any kind) for heads of this k and
    hidden size (None: not checked), or None: what load_predictor refuses and mtp-report shows."""
    if meta.get("kind") not in PREDICTOR_KINDS or (kind is not None and meta["kind"] != kind):
        return (f"says kind {meta.get('kind')!r} where a {kind or '/'.join(PREDICTOR_KINDS)} predictor belongs "
                "(edited or moved); rerun `mtp-clp stage=fit`")
    for key, have in (("hidden_size", hidden_size), ("k", k)):
        if have is not None and meta.get(key) != have:
            return f"fitted for {key}={meta.get(key)}, these heads and backbone have {key}={have}: rerun mtp-clp for them"
    return None


def load_predictor(path: Path, hidden_size: int, k: int, backbone_name: str | None = None,
                   kind: str | None = None) -> tuple[SpanPredictor, dict]:
    """A saved predictor, refused when it was fitted for another hidden size, k or backbone, or (with
    `kind`) is not of the kind asked for."""
    from mtp_train.artifacts import load_weights, read_weights_meta

    meta, meta_file, weights = read_weights_meta(Path(path), PREDICTOR_META, PREDICTOR_FILE, "written by mtp-clp")
    if problem := predictor_mismatch(meta, kind, hidden_size, k):
        raise (MtpError if problem.startswith("says kind") else ConfigError)(f"{meta_file}: {problem}")
    if backbone_name is not None and meta.get("backbone") not in (None, backbone_name):
        raise ConfigError(f"{meta_file}: fitted for backbone {meta.get('backbone')!r}, not {backbone_name!r}")
    predictor = build_predictor(meta["kind"], hidden_size, k, meta.get("use_head_probs", False))
    state = load_weights(weights)  # an unreadable or non-finite file is named as such first
    check_predictor_weights(meta, weights)
    try:
        predictor.load_state_dict(state)
    except RuntimeError as e:  # torch lists every key: the first problem names it
        detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise MtpError(f"{weights}: does not fit a {meta['kind']} predictor ({detail[:200]}); rerun "
                       "`mtp-clp stage=fit`") from None
    return predictor.eval(), meta

