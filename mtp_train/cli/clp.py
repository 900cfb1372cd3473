"""mtp-clp: fit and calibrate the span-length predictor (issue 5; not implemented yet)."""

import hydra

from mtp_train.cli.common import CONF_DIR, entry, log


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def main(cfg, typed):
    log.error("mtp-clp is not implemented yet (the CLP lands with issue 5)")
    raise SystemExit(3)


if __name__ == "__main__":
    main()
