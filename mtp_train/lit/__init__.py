"""Lightning wiring: the heads LightningModule and the prepared-data DataModule."""
