"""mtp-train: multi-token-prediction draft heads and span-length predictors on a frozen causal LM."""

__version__ = "0.1.0"
