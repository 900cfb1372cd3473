"""mtp-clp: self-generated acceptance labels -> span-length predictors (clp, gate) -> a calibrated threshold.

  mtp-clp clp.heads=runs/demo/train                      # stage=all: label, fit, calibrate
  mtp-clp clp.heads=... stage=label                      # decode train prompts, record m* per step
  mtp-clp clp.heads=... stage=fit clp.use_head_probs=true

Writes into the run directory: acceptance_labels/ (HF dataset + manifest), and per predictor kind a directory
(clp/, gate/) with <kind>.safetensors-style clp.safetensors + clp.json (k, d, threshold, bounds, figures)
that `mtp-eval eval.clp=<run>/clp eval.gate=<run>/gate` loads.
"""

from __future__ import annotations

import hydra

from mtp_train.config import Config
from mtp_train.entry import CONF_DIR, entry
from mtp_train.pipeline.clp_run import run_clp


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def main(cfg, typed: Config):
    run_clp(typed)


if __name__ == "__main__":
    main()
