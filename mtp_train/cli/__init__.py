"""Hydra entry points: each composes conf/, validates it, runs one job and returns its metric."""
