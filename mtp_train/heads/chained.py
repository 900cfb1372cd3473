"""Chained MTP modules (DeepSeek-V3 technical report, section 2.2; "Match the Distribution").

Module j (1..k) at position t combines the previous depth's hidden state (the backbone's h_t for
j=1) with the embedding of the token one step ahead of it, x_{t+j}:

    x = W_j [RMSNorm(emb(x_{t+j})); RMSNorm(h^{j-1}_t)]        W_j: 2d -> d, [emb; h] order as released
    h^j = Block_j(x)                                            one causal transformer layer + norm
    logits = lm_head(h^j)                                       the backbone's shared LM head

and drafts token t+1+j; module j+1 consumes h^j. Training feeds the ground-truth tokens (teacher
forcing); decoding feeds the tokens just drafted, and each module keeps its own KV cache.

The block is a one-layer model of the backbone's own architecture (built from its config with
`num_hidden_layers=1` and no embedding table), so rotary embeddings, attention masks and caches are
the backbone's own code. W_j starts as [0 | I] (the module first sees the backbone's hidden state
alone). The block starts from the architecture's random init (`heads.init=random`, the default): its
attention and MLP add little at first, so module 1 starts near "the backbone's own next-token
distribution" and learns from there. `heads.init=copy_last` copies the backbone's last layer and final
norm instead; that layer expects the un-normalised residual stream, not the final (normed) state it
gets here, and it starts far worse and stays behind (docs/results.md, "How the demo's recipe was
chosen").

`heads.share=true` applies module 1's weights at every depth (EAGLE's one draft layer): h^j plays
the part of the backbone's state one position on, so one module learns from all k depths' targets
with 1/k of the parameters. Each depth still attends over its own states (its own KV cache).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from mtp_train.heads.base import DraftHeads


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def one_layer_model(backbone_config, init_from: nn.Module | None = None) -> nn.Module:
    """A base model of the backbone's architecture with one layer and no embedding table."""
    from transformers import AutoModel

    cfg = copy.deepcopy(backbone_config)
    cfg.num_hidden_layers = 1
    if hasattr(cfg, "layer_types") and cfg.layer_types:
        cfg.layer_types = cfg.layer_types[-1:]
    model = AutoModel.from_config(cfg)
    model.embed_tokens = None  # inputs come as embeddings; the table would waste V x d weights
    if init_from is not None:  # the backbone's base model: copy its last layer and final norm
        # (the original weights: peft's LoRA wrapping renamed them `.base_layer.`; the adapters are not copied)
        state = {n.replace(".base_layer.", "."): t for n, t in init_from.layers[-1].state_dict().items()
                 if "lora_" not in n}
        model.layers[0].load_state_dict(state)
        model.norm.load_state_dict(init_from.norm.state_dict())
    return model


class ChainedMTP(DraftHeads):
    def __init__(self, backbone_config, k: int, init_from: nn.Module | None = None,
                 draft_ids: torch.Tensor | None = None, share: bool = False):
        super().__init__()
        d = backbone_config.hidden_size
        self.k, self.hidden_size, self.share = k, d, share
        self._init_draft(backbone_config.vocab_size, draft_ids)
        eps = getattr(backbone_config, "rms_norm_eps", 1e-6)
        n = 1 if share else k  # shared: module 1's weights serve every depth (each depth keeps its own cache)
        self.norm_emb = nn.ModuleList(RMSNorm(d, eps) for _ in range(n))
        self.norm_hidden = nn.ModuleList(RMSNorm(d, eps) for _ in range(n))
        self.proj = nn.ModuleList(nn.Linear(2 * d, d, bias=False) for _ in range(n))
        with torch.no_grad():
            for p in self.proj:
                p.weight.zero_()
                p.weight[:, d:].copy_(torch.eye(d))  # [0 | I]: start from the hidden state
        self.blocks = nn.ModuleList(one_layer_model(backbone_config, init_from) for _ in range(n))

    @classmethod
    def from_config(cls, cfg, backbone, draft_ids=None) -> ChainedMTP:
        init_from = backbone.model.base_model if cfg.init == "copy_last" else None
        return cls(backbone.config, cfg.k, init_from=init_from, draft_ids=draft_ids, share=cfg.share)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module,
                attention_mask: torch.Tensor | None = None, aux=None) -> torch.Tensor:
        """hidden (B, T, d), input_ids (B, T) -> per-depth hidden states (B, T, k, d).

        Module j at position t reads token x_{t+j}; positions where t+j runs past the sequence read a
        zero embedding (their targets lie outside the sequence and are masked by the loss).
        """
        B, T, d = hidden.shape
        emb_all = embed(input_ids)  # (B, T, d)
        outs, h = [], hidden
        for j in range(1, self.k + 1):
            ahead = torch.zeros_like(emb_all)
            ahead[:, : T - j] = emb_all[:, j:]  # (B, T, d): emb(x_{t+j})
            h = self.module_step(j, h, ahead, attention_mask=attention_mask)
            outs.append(h)
        return torch.stack(outs, dim=2)  # (B, T, k, d)

    def module_step(self, j: int, prev: torch.Tensor, token_emb: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, cache=None,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Module j (1..k) on (B, n, d) previous-depth states and embeddings of the tokens j ahead ->
        (B, n, d). With a transformers `cache` holding the module's earlier positions (decoding), the
        n positions continue after them; tree drafting passes a 4D mask and explicit positions."""
        i = 0 if self.share else j - 1
        x = self.proj[i](torch.cat([self.norm_emb[i](token_emb), self.norm_hidden[i](prev)], -1))
        out = self.blocks[i](inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                 use_cache=cache is not None, position_ids=position_ids)
        return out.last_hidden_state

