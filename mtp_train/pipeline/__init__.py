"""The library behind each entry point: what mtp-train, mtp-clp, mtp-eval and mtp-export-heads do,
callable without Hydra (tests and benchmarks call these with a typed Config)."""
