"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"), in the layout vLLM and SGLang serve (the `speculators` "eagle3"
format; `mtp-export-heads --format eagle3`).

One draft layer is reused at every depth. Its first input fuses three of the backbone's hidden
states, taken at the inputs of decoder layers `aux_layers` (by default 2, L/2 and L-3: low, middle and
high features; the final state alone is what the other families see):

    g_t   = fc([a^1_t; a^2_t; a^3_t])                     fc: 3d -> d
    z     = [input_layernorm(emb(x)); hidden_norm(h)]     2d wide: q, k and v read both halves
    h'    = h + attn(z) (+ MLP with its own norm)         residual: h (or hidden_norm(h), see below)
    logits = lm_head(norm(h'))                            over the draft vocabulary

Depth 1 at position t reads (h = g_t, x = x_{t+1}) at rotary position t and drafts x_{t+2}; depth
j > 1 reads the layer's own previous output h' and the token drafted at depth j-1 (training: the
data's x_{t+j}, teacher forcing) at position t + j - 1. Each depth's query attends to the depth-1 keys
of positions <= t plus the keys of its own earlier depths at t ("training-time test"): exactly what
an engine's drafter sees when it drafts j tokens after position t. `norm_before_residual` uses
hidden_norm(h) as the residual (a variant some released drafters use; the engines' defaults differ,
so the export writes it). The LM head is the backbone's rows for the draft vocabulary, frozen and
passed in at call time like the token embedding (`heads.lm_head=shared`, as `speculators` trains it),
or a trainable copy (`copy`).

The layer is a Llama layer built from the backbone's own sizes and rotary settings, so the exported
`transformer_layer_config` is a Llama config; attention is written out here (eager, float32 scores)
because training-time test's key pattern is not a causal mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtp_train.errors import ConfigError
from mtp_train.heads.base import DraftHeads


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice, [2, L // 2, L - 3]; a backbone with too few layers for three distinct ones
    (the tiny test models) takes up to three of [1, L // 2, L - 1] instead."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    return sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1})


def check_aux_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    """Layer ids name the input of that decoder layer (0 = the embeddings), as vLLM records them, and
    are fused in ascending order, the order the engines collect them in."""
    ids = [int(i) for i in aux_layers]
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(f"heads.aux_layers must be distinct layer ids in [0, {num_layers - 1}] for a "
                         f"backbone with {num_layers} layers, got {ids}")
    return sorted(ids)


def draft_layer_config(backbone_config):
    """A one-layer Llama config with the backbone's sizes, norms and rotary settings."""
    from transformers import LlamaConfig

    c = backbone_config
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default",
                                                   "rope_theta": getattr(c, "rope_theta", 10000.0)}
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        hidden_act=getattr(c, "hidden_act", "silu"), rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
        rope_parameters=dict(rope), attention_bias=bool(getattr(c, "attention_bias", False)),
        mlp_bias=bool(getattr(c, "mlp_bias", False)), tie_word_embeddings=False,
        bos_token_id=getattr(c, "bos_token_id", None), eos_token_id=getattr(c, "eos_token_id", None),
        pad_token_id=getattr(c, "pad_token_id", None),
    )


class _Attention(nn.Module):
    """q, k, v read the 2d-wide [embedding; hidden] input; o maps back to d."""

    def __init__(self, cfg):
        super().__init__()
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg, norm_before_residual: bool = False):
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """emb, h (B, n, d) -> q (B, H, n, hd), k and v (B, H_kv, n, hd) with rotary applied, and
        the residual (B, n, d)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        hn = self.hidden_norm(h)
        z = torch.cat([self.input_layernorm(emb), hn], -1)
        a = self.self_attn
        B, n = z.shape[:2]
        q = a.q_proj(z).view(B, n, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(z).view(B, n, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(z).view(B, n, a.n_kv, a.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, (hn if self.norm_before_residual else h)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output (B, H, n, hd) and residual (B, n, d) -> the layer's output (B, n, d)."""
        B, H, n, hd = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, n, H * hd))
        return h + self.mlp(self.post_attention_layernorm(h))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class Eagle3Heads(DraftHeads):
    def __init__(self, backbone_config, k: int, aux_layers: list[int], lm_head_weight: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None, norm_before_residual: bool = False):
        """`lm_head_weight` (V, d): given = a trainable LM head starting as its draft-vocabulary rows;
        None = the backbone's own rows, passed to `project` (frozen, never stored)."""
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.layer_config = cfg = draft_layer_config(backbone_config)
        d = cfg.hidden_size
        self.k, self.hidden_size = k, d
        self.aux_layers = check_aux_layers(aux_layers, backbone_config.num_hidden_layers)
        self.norm_before_residual = norm_before_residual
        self._init_draft(backbone_config.vocab_size, draft_ids)
        self.fc = nn.Linear(len(self.aux_layers) * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, norm_before_residual)])
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.lm_head = None
        if lm_head_weight is not None:
            rows = lm_head_weight if self.draft_ids is None else lm_head_weight[self.draft_ids.to(lm_head_weight.device)]
            self.lm_head = nn.Linear(d, len(rows), bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(rows)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    @classmethod
    def from_config(cls, cfg, backbone, draft_ids=None) -> Eagle3Heads:
        copy = backbone.lm_head.weight.detach() if cfg.lm_head == "copy" else None
        aux = cls.aux_layers_for(cfg, backbone.config)
        return cls(backbone.config, cfg.k, aux, copy, draft_ids=draft_ids,
                   norm_before_residual=cfg.norm_before_residual)

    @classmethod
    def aux_layers_for(cls, cfg, backbone_config) -> list[int]:
        """heads.aux_layers, or EAGLE-3's default; layers past the backbone's depth are refused here,
        so mtp-prep's cache and mtp-train agree (prep once wrote a cache train then refused)."""
        n = backbone_config.num_hidden_layers
        aux = list(cfg.aux_layers) if cfg.aux_layers is not None else default_aux_layers(n)
        try:
            check_aux_layers(aux, n)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return aux

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def lm_weight(self, lm_head: nn.Module, depth: int | None = None) -> torch.Tensor:
        """The LM head over the draft vocabulary, (|D|, d), one for every depth: trainable, or the
        backbone's rows."""
        return self.lm_head.weight if self.lm_head is not None else self.draft_weight(lm_head)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor):
        """cos, sin for positions (B, n)."""
        return self.rotary_emb(x, positions)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The backbone's auxiliary states (..., n_aux * d) -> the first depth's input (..., d)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module,
                attention_mask: torch.Tensor | None = None, aux: torch.Tensor | None = None) -> torch.Tensor:
        """Training-time test, teacher-forced: aux (B, T, n_aux * d) and input_ids (B, T) ->
        per-depth outputs (B, T, k, d), before the final norm. `hidden` (the final states) is unused.

        Depth j at position t reads x_{t+j} (a zero embedding past the end, whose targets the loss
        masks) and attends to the depth-1 keys of positions s <= t that are real tokens, and to its
        own depths 1..j-1 at t. Right padding only (rows start at position 0)."""
        if aux is None:
            raise ValueError("EAGLE-3 heads read the backbone's auxiliary hidden states (aux=)")
        B, T = input_ids.shape
        layer = self.layer
        emb_all = embed(input_ids).to(self.fc.weight.dtype)  # (B, T, d)
        h = self.fuse(aux)  # (B, T, d)
        base = torch.arange(T, device=h.device).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()  # (T, T)
        allow0 = causal[None] if attention_mask is None else causal[None] & attention_mask.bool()[:, None, :]
        keys, values, outs = [], [], []
        scale = 1.0 / math.sqrt(layer.self_attn.head_dim)
        groups = layer.self_attn.n_heads // layer.self_attn.n_kv
        for j in range(1, self.k + 1):
            ahead = torch.zeros_like(emb_all)
            if j < T:
                ahead[:, : T - j] = emb_all[:, j:]  # emb(x_{t+j})
            cos, sin = self.rotary(h, base + (j - 1))
            q, kk, vv, residual = layer.qkv(ahead, h, cos, sin)
            keys.append(_repeat_kv(kk, groups))
            values.append(_repeat_kv(vv, groups))
            qf = q.float()
            s0 = (qf @ keys[0].float().transpose(-1, -2)) * scale  # (B, H, T, T)
            s0 = s0.masked_fill(~allow0[:, None], float("-inf"))
            diag = [(qf * kk_i.float()).sum(-1, keepdim=True) * scale for kk_i in keys[1:]]  # (B, H, T, 1)
            p = torch.softmax(torch.cat([s0, *diag], -1), -1)
            out = p[..., :T] @ values[0].float()
            for i, v_i in enumerate(values[1:]):
                out = out + p[..., T + i: T + i + 1] * v_i.float()
            h = layer.finish(out.to(q.dtype), residual)
            outs.append(h)
        return torch.stack(outs, dim=2)  # (B, T, k, d)

    @torch.no_grad()
    def fit_to_final_state(self, aux: torch.Tensor, final: torch.Tensor, ridge: float = 1e-3) -> float:
        """`heads.init=final_state`: fc becomes the ridge least-squares map from the auxiliary states
        aux (n, n_aux * d) to the backbone's final states (n, d) at the same positions, and the final
        norm's gain their mean RMS, so the untrained head starts near the backbone's own next-token
        head (as Medusa's zero blocks and the chained modules' [0 | I] do), not from noise. Returns
        the fraction of the final states' variance the map explains."""
        A, H = aux.double(), final.double()
        gram = A.T @ A
        gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
        W = torch.linalg.solve(gram, A.T @ H).T  # (d, n_aux * d)
        self.fc.weight.copy_(W.to(self.fc.weight.dtype))
        self.norm.weight.fill_(float(H.pow(2).mean(-1).sqrt().mean()))
        resid = H - A @ W.T
        return float(1 - resid.pow(2).sum() / (H - H.mean(0)).pow(2).sum())

    def project(self, head_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(..., d) outputs before the final norm -> logits (..., |D|) after the final norm."""
        x = self.norm(head_hidden)
        return x @ self.lm_weight(lm_head).to(x.dtype).T

    # --- the engines' vocabulary maps -------------------------------------------------------------

    def d2t(self) -> torch.Tensor:
        """(|D|,) int64 offsets: draft index i is token i + d2t[i]."""
        ids = self.draft_ids if self.draft_ids is not None else torch.arange(self.vocab_size)
        return (ids.cpu() - torch.arange(len(ids))).to(torch.long)

    def t2d(self) -> torch.Tensor:
        """(V,) bool: which tokens the draft vocabulary holds."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.draft_ids.cpu() if self.draft_ids is not None else slice(None)] = True
        return mask


def attend_rows(layer: Eagle3Layer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                allow: torch.Tensor) -> torch.Tensor:
    """Decoding: queries (1, H, m, hd) over keys/values (1, H_kv, L, hd) where `allow` (m, L) is
    True -> (1, H, m, hd), float32 scores as in training."""
    groups = layer.self_attn.n_heads // layer.self_attn.n_kv
    k, v = _repeat_kv(keys, groups).float(), _repeat_kv(values, groups).float()
    s = (q.float() @ k.transpose(-1, -2)) / math.sqrt(layer.self_attn.head_dim)
    s = s.masked_fill(~allow.to(s.device)[None, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).to(q.dtype)


__all__ = ["Eagle3Heads", "Eagle3Layer", "attend_rows", "check_aux_layers", "default_aux_layers",
           "draft_layer_config"]
