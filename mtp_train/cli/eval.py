"""mtp-eval: measure decoding with trained heads against HF generate (issue 4; not implemented yet)."""

import hydra

from mtp_train.cli.common import CONF_DIR, entry, log


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def main(cfg, typed):
    log.error("mtp-eval is not implemented yet (the evaluator lands with issue 4)")
    raise SystemExit(3)


if __name__ == "__main__":
    main()
