"""mtp-train: train k draft heads on a frozen backbone; writes heads.safetensors + heads.json.

  mtp-prep debug=smoke && mtp-train debug=smoke          # a tiny Llama, in-code data, 4 steps
  mtp-train heads=medusa heads.k=4 loss=kl loss.adamtp=true
  mtp-train -m loss=ce,e2e_tv heads.k=2,3 backbone=tiny    # local sweep, one run dir per point
  mtp-train hydra.run.dir=runs/my_run                      # rerun the same command to resume
  mtp-train -m experiment=smollm2_sweep hydra/launcher=slurm  # k x loss, each point trained and decoded

Returns `val/sim_tau` (the accepted length greedy verification would reach on validation
positions), so Hydra sweepers can optimise it. Resumes from `<run dir>/checkpoints/last.ckpt` when
it exists. Lightning checkpoints hold only the heads and optimizer state, never the backbone.
"""

from __future__ import annotations

import hydra

from mtp_train.cli.common import CONF_DIR, entry, offline_environment, run_app
from mtp_train.config import Config
from mtp_train.pipeline.training import eval_trained, run_train


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def app(cfg, typed: Config):
    sim_tau = run_train(typed).get("val/sim_tau")
    if typed.train.eval_after:
        eval_trained(typed)
    return sim_tau


def main() -> None:
    offline_environment()
    run_app(app)


if __name__ == "__main__":
    main()
