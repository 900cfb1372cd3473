"""mtp-eval: what trained heads buy when decoding, against HF generate greedy on the same prompts.

  mtp-eval eval.train_run=runs/demo/train                                  # greedy + verify
  mtp-eval eval.train_run=runs/demo/train eval.modes=[greedy,verify,relaxed,adaptive]
  mtp-eval eval.train_run=... eval.prompts=my_prompts.jsonl eval.n_prompts=null
  mtp-eval eval.train_run=... eval.prompt_source=unseen eval.rounds=5   # prompts the data stage never took

Writes eval_report.json, outputs.json (every mode's text per prompt), speedup.png and
acceptance.png into the run directory, prints the table, and logs the same to W&B with logger=wandb.
"""

from __future__ import annotations

import hydra

from mtp_train.cli.common import CONF_DIR, entry, offline_environment, run_app
from mtp_train.config import Config
from mtp_train.pipeline.evaluation import run_eval


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def app(cfg, typed: Config):
    run_eval(typed)


def main() -> None:
    offline_environment()
    run_app(app)


if __name__ == "__main__":
    main()
