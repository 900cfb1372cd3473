"""The one door from the library to Hydra: building the trainer and loggers from their config nodes
(`_target_` in conf/trainer/, conf/logger/) with Hydra's own instantiate. Everything else of Hydra
(composition, the ConfigStore, launchers, the sweep callback) stays in mtp_train/cli/."""

from hydra.utils import instantiate

__all__ = ["instantiate"]
