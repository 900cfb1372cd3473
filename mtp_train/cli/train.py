"""mtp-train: train draft heads on a frozen backbone (issue 3; not implemented yet)."""

import hydra

from mtp_train.cli.common import CONF_DIR, entry, log


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def main(cfg, typed):
    log.error("mtp-train is not implemented yet (head training lands with issue 3)")
    raise SystemExit(3)


if __name__ == "__main__":
    main()
