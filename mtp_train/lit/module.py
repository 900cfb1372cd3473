"""LightningModule that trains draft heads on a frozen backbone.

The backbone is held as a plain attribute (a `Backbone` dataclass, not a submodule), so Lightning's
optimizer, state_dict and checkpoints see only the heads, plus, with `backbone.lora`, the backbone's
LoRA layers (registered as `adapters`), never its base weights: `heads.heads_state_dict` is the one
function that decides what a heads file holds. One `model_step` serves training and validation.

Logged per depth j (keys `split/name_dj`): loss, acc (argmax == data token), agree (argmax == the
backbone's own greedy token), alpha (1 - TV), masked (AdaMTP fraction dropped) and `val/sim_tau`:
the accepted length greedy verification would reach on these teacher-forced positions,
1 + mean_t sum_j prod_{i<=j} agree_{t,i}, over positions where all k depths have a target;
`val/sim_tau_t<T>` for each train.sampled_tau_temperatures: the same with agree replaced by
sum_x min(p_T, q_T), what speculative sampling of a chain at temperature T would accept.

Validation also records rank statistics for token trees (`mtp_train.trees`): at positions whose
k-token window lies on the backbone's greedy path (so the heads see what decoding shows them), the
rank of the backbone's greedy token among each head's candidates, by the backbone's entropy there.
`rank_stats` holds the last validation's counts (mtp-train saves them as tree_stats.json) and
`val/sim_tau_tree` is the accepted length a static tree of TREE_METRIC_NODES drafts grown from
them reaches (grown on one half of the positions, scored on the other).
"""

from __future__ import annotations

import lightning as L
import torch

from mtp_train.config import LoraConfig, LossConfig, TrainConfig
from mtp_train.depth_targets import depth_targets
from mtp_train.errors import MtpError
from mtp_train.lit.schedule import lr_scheduler
from mtp_train.losses import (
    LossOutput,
    acceptance,
    backbone_distill_loss,
    compute_loss,
    sampled_acceptance,
    topk_loss,
)
from mtp_train.segmentation import adamtp_mask_from_entropy, masked_fraction
from mtp_train.teacher import backbone_stats, positions_ahead, teacher_log_probs, tempered_log_norms
from mtp_train.trees import (
    ENTROPY_EDGES,
    RankStats,
    cross_fit_tau,
    dense_counts,
    entropy_bucket,
    head_ranks,
)

TREE_METRIC_NODES = 16
# train/alpha_d* is estimated on every this-many-th position of a training batch (validation's on all)
TRAIN_ALPHA_STRIDE = 8


class NonFiniteLoss(MtpError):
    pass


class MTPHeadsModule(L.LightningModule):
    def __init__(self, backbone, heads: torch.nn.Module, loss_cfg: LossConfig, train_cfg: TrainConfig,
                 lora_cfg: LoraConfig | None = None, train_alpha_stride: int = TRAIN_ALPHA_STRIDE):
        super().__init__()
        self.backbone = backbone  # not an nn.Module: its base weights are never trained or checkpointed
        self.heads = heads
        self.loss_cfg, self.train_cfg = loss_cfg, train_cfg
        self.train_alpha_stride = train_alpha_stride  # 1: every position (bench/step_options.py's alpha-all)
        # with backbone.lora: the backbone's LoRA layers, registered here so that the optimizer, DDP
        # and checkpoints see them (the same objects the backbone runs); None otherwise
        self.lora_cfg = lora_cfg if lora_cfg is not None and lora_cfg.enabled else None
        self.adapters = None
        if self.lora_cfg is not None:
            from mtp_train.adapters import adapter_modules

            self.adapters = adapter_modules(backbone.model)
            if self.adapters is None:
                raise MtpError("backbone.lora.enabled is set, but the backbone carries no LoRA layers")
        self.k = heads.k
        self._val_chain, self._val_sampled = [], {}
        self._val_ranks, self._val_dense = [], None
        self.max_rank = RankStats.rank_cap(self.k)
        self.rank_stats: RankStats | None = None
        self.lr_shape = None  # the schedule's length, set by configure_optimizers

    def on_fit_start(self) -> None:
        """Put the frozen backbone next to the heads, in their dtype when the strategy made them half
        precision (DeepSpeed bf16 casts the modules it wraps; the backbone is not one of them)."""
        dtype = next(self.heads.parameters()).dtype
        model = self.backbone.model.to(self.device)
        if dtype in (torch.bfloat16, torch.float16):
            for p in model.parameters():  # weights only: buffers such as RoPE's inv_freq stay fp32
                p.data = p.data.to(dtype)

    def on_train_start(self) -> None:  # a resumed mid-epoch run starts here, not at an epoch start
        self._schedule_length()
        self.on_train_epoch_start()

    def _schedule_length(self) -> None:
        """The schedule's length for this fit, after a checkpoint was restored (the scheduler's state
        carries the length it ran over, which a longer trainer.max_steps must replace): a time
        budget's plan when it has one, else trainer.max_steps."""
        from mtp_train.lit.budget import TimeBudget

        if self.lr_shape is None:
            return
        budget = next((cb for cb in self.trainer.callbacks if isinstance(cb, TimeBudget)), None)
        if budget is None:
            self.lr_shape.total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0
                                      else self.trainer.estimated_stepping_batches)
        elif budget.planned is not None:
            self.lr_shape.total = budget.planned

    def on_train_epoch_start(self) -> None:
        """After a mid-epoch resume, skip the rows this epoch already trained on."""
        # every epoch has the same number of batches (one optimizer step each), so the steps
        # beyond whole epochs are the batches of this epoch that are already done
        done = self.global_step - self.current_epoch * self.trainer.num_training_batches
        sampler = getattr(self.trainer.datamodule, "sampler", None) if self.trainer.datamodule else None
        if done > 0 and sampler is not None:
            sampler.skip = done * self.train_cfg.batch_size

    # --- the step shared by train and validation ---------------------------------------------------

    def model_step(self, batch: dict, split: str) -> torch.Tensor:
        ids, labels, attn = batch["input_ids"], batch["labels"], batch["attention_mask"]
        heads, lm_head = self.heads, self.backbone.lm_head
        aux_layers = list(heads.aux_layers)  # backbone layers the heads read besides the final state
        distill = None
        if "hidden" in batch:  # from the hidden-state cache: no backbone layer and no V-sized logits
            hidden, aux, full, stats = self._cached_states(batch, aux_layers)
        elif self.adapters is not None:  # the adapted backbone, live, with gradients into the adapters
            hidden, aux = self.backbone.hidden_and_aux(ids, attn, aux_layers)  # (B, T, d), (B, T, n * d)
            full = self.backbone.logits(hidden)  # (B, T, V)
            stats = backbone_stats(full.detach())
            if self.lora_cfg.distill_weight > 0:
                distill = self._distill_term(ids, attn, full)
        else:
            with torch.no_grad():
                hidden, aux = self.backbone.hidden_and_aux(ids, attn, aux_layers)  # (B, T, d), (B, T, n * d)
                full = self.backbone.logits(hidden)  # (B, T, V)
                stats = backbone_stats(full)
        targets, valid = depth_targets(ids, labels, self.k, attn)  # (B, T, k) x 2
        rows = valid.any(-1)  # (B, T) positions with at least one target: only these are projected
        if not rows.any():  # no MTP target in this batch: only the distillation term (if any) counts
            extra = 0.0 if distill is None else self.lora_cfg.distill_weight * distill
            return self.heads_zero() + extra
        noise = self.train_cfg.feature_noise if split == "train" else 0.0
        head_hidden = heads(with_noise(hidden, noise), ids, self.backbone.embed_tokens, attn,
                            aux=with_noise(aux, noise))  # (B, T, k, d); the teacher keeps the clean states
        logits = heads.project(head_hidden[rows], lm_head)[None]  # (1, N, k, |D|)
        with torch.no_grad():
            weight = heads.draft_weight(lm_head)  # (|D|, d)
            teacher = teacher_log_probs(hidden, stats["lse"], rows, self.k, weight,
                                        logits=full if heads.draft_ids is None else None)[None]
            b, pos = positions_ahead(rows, self.k)  # (N, 1), (N, k)
            bb_top = stats["top"][b, pos][None]  # (1, N, k) the backbone's greedy token per depth
            log_norms = None  # for val/sim_tau_t<T> over a draft vocabulary: (n_T, N, k)
            if split == "val" and heads.draft_ids is not None:
                log_norms = tempered_log_norms(stats["lse"], self.train_cfg.sampled_tau_temperatures, logits=full,
                                               hidden=hidden, lm_head=lm_head)[:, b, pos]
        mask = valid[rows][None]  # (1, N, k)
        target_tok = targets[rows][None]  # (1, N, k) token ids
        if self.loss_cfg.adamtp:
            lc = self.loss_cfg
            ada = adamtp_mask_from_entropy(stats["entropy"], self.k, lc.segment_rule, lc.theta,
                                           lc.zscore_window, lc.zscore_threshold,
                                           valid_tokens=attn.bool())  # (B, T, k)
            frac = masked_fraction(ada & valid, valid)  # (k,)
            for j in range(self.k):
                self.log(f"{split}/masked_d{j + 1}", frac[j], on_step=False, on_epoch=True,
                         sync_dist=split == "val")
            mask = mask & ada[rows][None]
        target_idx = heads.to_draft(target_tok)  # (1, N, k), -1 outside the draft vocabulary
        name = self.loss_name()
        if name == "ce":  # a token the heads cannot score is no CE target
            mask = mask & (target_idx >= 0)
        out = compute_loss(name, logits, targets=target_idx.clamp(min=0),
                           teacher_logits=teacher, mask=mask, depth_weights=self.loss_cfg.depth_weights,
                           teacher_logprobs=True)
        if self.loss_cfg.topk and self.loss_cfg.topk_weight > 0:
            extra = topk_loss(logits, teacher, mask, self.loss_cfg.topk, self.loss_cfg.depth_weights,
                              teacher_logprobs=True)
            self.log(f"{split}/loss_topk", extra.loss, on_step=split == "train", on_epoch=True,
                     sync_dist=split == "val")
            out = LossOutput(loss=out.loss + self.loss_cfg.topk_weight * extra.loss,
                             per_depth=out.per_depth, alpha=out.alpha)
        if self.adapters is not None and "hidden" not in batch:
            # every adapter in the graph, if only with weight 0: an adapter past the last layer the
            # heads read (EAGLE-3) gets no other gradient without the distillation term, which DDP
            # (find_unused_parameters=false) would stop on
            extra = sum(p.sum() for p in self.adapters.parameters()) * 0.0
            if distill is not None:
                self.log(f"{split}/loss_distill", distill, on_step=split == "train", on_epoch=True,
                         sync_dist=split == "val")
                extra = extra + self.lora_cfg.distill_weight * distill
            out = LossOutput(loss=out.loss + extra, per_depth=out.per_depth, alpha=out.alpha)
        if not torch.isfinite(out.loss):
            bad = [j + 1 for j in range(self.k) if not torch.isfinite(out.per_depth[j])]
            raise NonFiniteLoss(f"non-finite {name} loss at step {self.global_step} "
                                f"({split}), depth(s) {bad or 'all'}; the last good checkpoint is kept")
        self._log_metrics(split, out, logits.detach(), teacher, target_tok, bb_top, valid[rows][None], log_norms)
        if split == "val":
            self._collect_ranks(logits.detach()[0], bb_top[0], valid[rows], ids, stats, rows)
        return out.loss

    @torch.no_grad()
    def _cached_states(self, batch: dict, aux_layers):
        """(hidden (B, T, d), aux (B, T, n_aux * d) or None, no logits, stats) from the cache's batch."""
        dtype = self.backbone.lm_head.weight.dtype
        stats = {name: batch[name] for name in ("lse", "top", "entropy")}  # (B, T) each
        aux = None
        if aux_layers:
            if "aux" not in batch:
                raise MtpError("the hidden-state cache holds no auxiliary layer states; build it "
                               "with `mtp-prep stage=cache` and the same heads= settings")
            aux = batch["aux"].to(dtype)
        return batch["hidden"].to(dtype), aux, None, stats

    def _distill_term(self, ids: torch.Tensor, attn: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """KL(original || adapted) of the next-token distribution, per real token: the original's
        logits come from the same weights with the adapters bypassed (no gradient)."""
        from mtp_train.adapters import adapters_disabled

        with torch.no_grad(), adapters_disabled(self.backbone.model):
            reference = self.backbone.logits(self.backbone.hidden_states(ids, attn))  # (B, T, V)
        return backbone_distill_loss(logits, reference, attn)

    def loss_name(self) -> str:
        """The loss in force now (`loss.schedule` may switch it part-way through training)."""
        max_steps = self.total_steps()
        return self.loss_cfg.name_at(self.global_step, max_steps) if max_steps else self.loss_cfg.name

    def total_steps(self) -> int:
        """The length of training the schedules run over: the planned steps under a time budget,
        else trainer.max_steps (0 when neither is known)."""
        if getattr(self, "lr_shape", None) is not None:
            return self.lr_shape.total
        trainer = self._trainer
        return trainer.max_steps if trainer is not None and trainer.max_steps > 0 else 0

    def heads_zero(self) -> torch.Tensor:
        return sum(p.sum() * 0.0 for p in self.parameters())

    @torch.no_grad()
    def _log_metrics(self, split, out, logits, teacher, targets, bb_top, valid, log_norms=None) -> None:
        top = self.heads.to_tokens(logits.argmax(-1))  # (1, N, k) token ids
        acc = (top == targets) & valid
        agree = (top == bb_top) & valid
        # alpha reads the whole (N, k, |D|) distributions three times more (softmax, p, min): about a
        # tenth of a training step on the demo's heads (docs/training.md). A training step estimates it
        # on every TRAIN_ALPHA_STRIDE-th position; validation computes it on all
        stride = self.train_alpha_stride if split == "train" else 1
        alpha = acceptance(logits[:, ::stride], teacher[:, ::stride], teacher_logprobs=True)  # (1, N / stride, k)
        n_alpha = valid[:, ::stride].sum(dim=(0, 1)).clamp_min(1)  # (k,)
        n = valid.sum(dim=(0, 1)).clamp_min(1)  # (k,)
        on_step = split == "train"
        # validation figures are averaged over data-parallel ranks (training ones are this rank's)
        kw = {"on_step": on_step, "on_epoch": True, "sync_dist": split == "val"}
        self.log(f"{split}/loss", out.loss, prog_bar=True, **kw)
        for j in range(self.k):
            d = f"_d{j + 1}"
            self.log(f"{split}/loss{d}", out.per_depth[j], **kw)
            self.log(f"{split}/acc{d}", acc[..., j].sum() / n[j], **kw)
            self.log(f"{split}/agree{d}", agree[..., j].sum() / n[j], **kw)
            self.log(f"{split}/alpha{d}", (alpha[..., j] * valid[:, ::stride, j]).sum() / n_alpha[j], **kw)
        if split == "val":
            full = valid.all(-1)  # (1, N): positions with every depth's target
            chain = agree[full].float().cumprod(-1).sum(-1)  # (M,) accepted drafts per position
            self._val_chain.append(chain.cpu())
            for i, t in enumerate(self.train_cfg.sampled_tau_temperatures):  # expected accepted drafts at t
                norm = None if log_norms is None else log_norms[i][full[0]]  # (M, k)
                alpha_t = torch.stack([sampled_acceptance(logits[0, full[0], j], teacher[0, full[0], j], t,
                                                          None if norm is None else norm[:, j])
                                       for j in range(self.k)], -1)  # (M, k), one depth at a time
                self._val_sampled.setdefault(t, []).append(alpha_t.cumprod(-1).sum(-1).cpu())

    @torch.no_grad()
    def _collect_ranks(self, logits, bb_top, valid, ids, stats, rows) -> None:
        """logits (N, k, |D|), bb_top (N, k) the backbone's greedy token per depth, valid (N, k)."""
        b, pos = positions_ahead(rows, self.k)  # (N, 1), (N, k): t+1..t+k
        on_path = (ids[b, pos] == stats["top"][b, pos - 1]).all(-1) & valid.all(-1)  # (N,)
        if not on_path.any():
            return
        ranks = head_ranks(logits[on_path].float(), self.heads.to_draft(bb_top[on_path]), self.max_rank)
        bucket = entropy_bucket(stats["entropy"][b[:, 0], pos[:, 0] - 1][on_path])
        dense = dense_counts(ranks, bucket, self.max_rank, len(ENTROPY_EDGES) + 1)
        self._val_dense = dense if self._val_dense is None else self._val_dense + dense
        self._val_ranks.append(ranks.cpu())

    def training_step(self, batch, batch_idx):
        return self.model_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self.model_step(batch, "val")

    def on_validation_epoch_start(self) -> None:
        self._val_chain, self._val_sampled = [], {}
        self._val_ranks, self._val_dense = [], None

    def on_validation_epoch_end(self) -> None:
        self.log("val/sim_tau", self._mean_tau(self._val_chain), prog_bar=True)
        for t in self.train_cfg.sampled_tau_temperatures:
            self.log(f"val/sim_tau_t{t:.1f}", self._mean_tau(self._val_sampled.get(t, [])))
        n_cells = (len(ENTROPY_EDGES) + 1) * (self.max_rank + 1) ** self.k
        dense = self._val_dense if self._val_dense is not None else torch.zeros(
            len(ENTROPY_EDGES) + 1, n_cells // (len(ENTROPY_EDGES) + 1), dtype=torch.long, device=self.device)
        dense = self.trainer.strategy.reduce(dense.double(), reduce_op="sum").round().long().cpu()
        self.rank_stats = RankStats(k=self.k, max_rank=self.max_rank)
        self.rank_stats.add_dense(dense)
        rows = torch.cat(self._val_ranks) if self._val_ranks else torch.zeros(0, self.k, dtype=torch.long)
        # this rank's positions (all of them with one process)
        self.log("val/sim_tau_tree", cross_fit_tau(rows, TREE_METRIC_NODES, self.max_rank))
        self._wandb_depth_chart()

    def _mean_tau(self, chains: list[torch.Tensor]) -> float:
        """1 + the mean accepted drafts per position over every rank's positions, exactly: the sum
        and the count of each rank's, reduced, then divided."""
        chain = torch.cat(chains) if chains else torch.zeros(0)
        totals = torch.tensor([chain.double().sum().item(), float(chain.numel())], device=self.device,
                              dtype=torch.float64)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        return 1.0 + (totals[0] / totals[1]).item() if totals[1] > 0 else 1.0

    def _wandb_depth_chart(self) -> None:
        """A per-depth acceptance bar chart in W&B (agreement with the backbone and 1 - TV)."""
        from lightning.pytorch.loggers import WandbLogger

        loggers = [lg for lg in self.loggers if isinstance(lg, WandbLogger)]
        if not loggers or self.trainer.sanity_checking:
            return
        import wandb

        m = self.trainer.callback_metrics
        rows = [[f"d{j}", float(m.get(f"val/agree_d{j}", float("nan"))),
                 float(m.get(f"val/alpha_d{j}", float("nan")))] for j in range(1, self.k + 1)]
        table = wandb.Table(columns=["depth", "agree", "alpha"], data=rows)
        for lg in loggers:
            lg.experiment.log({"val/acceptance_per_depth": wandb.plot.bar(
                table, "depth", "agree", title="greedy agreement per depth"),
                "trainer/global_step": self.global_step})

    # --- optimisation -----------------------------------------------------------------------------

    def param_groups(self) -> list[dict]:
        """AdamW groups: weight decay on matrices only; norms' gains and biases (1-D) go undecayed."""
        params = [p for p in self.heads.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.train_cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if self.adapters is not None:  # LoRA's A and B matrices, at backbone.lora.lr (default train.lr)
            lr = self.lora_cfg.lr or self.train_cfg.lr
            groups.append({"params": [p for p in self.adapters.parameters() if p.requires_grad],
                           "weight_decay": self.train_cfg.weight_decay, "lr": lr})
        return groups

    def configure_optimizers(self):
        groups = [g for g in self.param_groups() if g["params"]]
        betas = tuple(float(b) for b in self.train_cfg.adam_betas)
        if _offloads_optimizer(self.trainer.strategy):  # ZeRO-Offload steps the optimizer on the CPU
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(groups, lr=self.train_cfg.lr, betas=betas, adamw_mode=True)
        else:
            opt = torch.optim.AdamW(groups, lr=self.train_cfg.lr, betas=betas)
        total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0
                    else self.trainer.estimated_stepping_batches)
        sched = lr_scheduler(opt, self.train_cfg, total)
        self.lr_shape = sched.lr_lambdas[0]  # a time budget revises its length (mtp_train/lit/budget.py)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def with_noise(x: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """train.feature_noise: the states the heads read, each vector plus uniform noise in
    [-scale, scale] x its own RMS (EAGLE trains its drafter on noised features so that it copes with
    the drift of the states it is fed while decoding; relative to the RMS so one setting suits any
    backbone's scale). Unchanged for scale 0 and for None."""
    if x is None or scale <= 0:
        return x
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)
    return x + (torch.rand_like(x) * 2 - 1) * (scale * rms)


def _offloads_optimizer(strategy) -> bool:
    """Whether a (DeepSpeed) strategy's ZeRO config offloads the optimizer state to the CPU."""
    from mtp_train.distributed import zero_config

    return (zero_config(strategy).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
