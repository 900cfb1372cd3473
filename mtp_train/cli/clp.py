"""mtp-clp: self-generated acceptance labels -> span-length predictors (clp, gate) -> a calibrated threshold.

  mtp-clp clp.train_run=runs/demo/train                      # stage=all: label, fit, calibrate
  mtp-clp clp.train_run=... stage=label                      # decode train prompts, record m* per step
  mtp-clp clp.train_run=... stage=fit clp.use_head_probs=true

Writes into the run directory: acceptance_labels/ (HF dataset + manifest), and per predictor kind a directory
(clp/, gate/) holding predictor.safetensors + predictor.json (k, d, threshold, bounds, figures)
that `mtp-eval eval.clp_run=<run>` loads.
"""

from __future__ import annotations

import hydra

from mtp_train.cli.common import CONF_DIR, entry, offline_environment, run_app
from mtp_train.config import Config
from mtp_train.pipeline.clp_run import run_clp


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def app(cfg, typed: Config):
    run_clp(typed)


def main() -> None:
    offline_environment()
    run_app(app)


if __name__ == "__main__":
    main()
