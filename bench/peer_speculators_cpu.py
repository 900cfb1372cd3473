"""Run speculators 0.9.0's own EAGLE-3 trainer (`python -m speculators.train`) on a CPU-only torch.

    <reference venv>/bin/python bench/peer_speculators_cpu.py --speculator-type eagle3 \\
        --verifier-name-or-path DIR --data-path DATA --target-layer-ids 2 15 27 --draft-vocab-size 8192 \\
        --mask-token-id 0 --total-seq-len 2048 --num-workers 0 --draft-attn-impl sdpa \\
        --loss-implementation eager --on-missing raise --optimizer adamw --max-steps N \\
        --no-resume-from-checkpoint --save-path OUT

Runs in the environment the reference tests build (.cache/reference-env/speculators-0.9.0, made by
tests/reference); it imports nothing of ours. Its trainer assumes an accelerator in three places,
which this wrapper points at the CPU without editing the package:
- the model and every batch are moved with `.to(local_rank)`, an integer that torch reads as the
  accelerator's index ("Cannot access accelerator device when none is available"): the rank
  lookup the trainer imports returns the CPU device instead;
- its step timer calls `torch.accelerator.synchronize()`: a no-op without an accelerator;
- autocast's device type falls back to "cuda": set to "cpu" after the trainer is built.
Two of its defaults need flags on a CPU (not patches): FlexAttention has no CPU backward
(`--draft-attn-impl sdpa`) and the fused loss needs triton (`--loss-implementation eager`). It must
run as one process: with LOCAL_RANK set it starts torch.distributed on the accelerator's backend.

Its data (read by speculators.train.data.ArrowDataset), which a converter from our cache writes:
a `datasets` folder (saved with the torch format) with columns input_ids (int64 [L]), loss_mask
(int64 [L], 1 = trained on) and seq_len; beside it hidden_states/hs_<row>.safetensors holding
"hidden_states" [L, n_aux + 1, H] (the aux layers in --target-layer-ids order, i.e. the residual
stream entering decoder layer j, then the last layer's output before the final norm) and
"token_ids" (= input_ids); rows unshifted (it shifts). d2t-N.npy / t2d-N.npy (or token_freq.pt,
from which it builds them) set the draft vocabulary. One step is one packed row of up to
--total-seq-len tokens, unrolled --ttt-steps (3) times; default optimizer Muon + AdamW, linear
schedule with 1% warm-up, no noise on the states. docs/training.md, "The peer's trainer".
"""

from __future__ import annotations

import os
import sys

os.environ.pop("LOCAL_RANK", None)  # the single-process path

import speculators.train.trainer as peer  # noqa: E402
import torch  # noqa: E402

peer.get_local_rank = lambda: torch.device("cpu")
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *a, **k: None

_built = peer.Trainer.__init__


def _on_cpu(self, *args, **kwargs):
    _built(self, *args, **kwargs)
    self.device_type = "cpu"


peer.Trainer.__init__ = _on_cpu

if __name__ == "__main__":
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(sys.argv[1:]))
