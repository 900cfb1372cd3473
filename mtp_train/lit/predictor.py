"""Fitting a span-length predictor on acceptance labels: class-weighted cross-entropy (m* = 0
dominates), AdamW; logs train/val loss and accuracy."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F


class SpanFitModule(L.LightningModule):
    def __init__(self, predictor, weights: torch.Tensor, lr: float):
        super().__init__()
        self.predictor, self.lr = predictor, lr
        self.register_buffer("weights", weights.float())

    def _step(self, batch, split: str):
        hidden, probs, labels = batch
        logits = self.predictor(hidden, probs)  # (B, k+1)
        loss = F.cross_entropy(logits, labels, weight=self.weights)
        acc = (logits.argmax(-1) == labels).float().mean()
        self.log(f"{split}/loss", loss, prog_bar=True, on_epoch=True, on_step=False)
        self.log(f"{split}/acc", acc, on_epoch=True, on_step=False)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.predictor.parameters(), lr=self.lr, weight_decay=0.01)
