"""A real serving engine run beside the project: vLLM's CPU build in its own environment
(`env.py`), driven through a worker script that imports only the engine (`worker.py`), and the
check that serves a run's exported heads and compares the engine's own acceptance counters with
the decoder's (`check.py`, `mtp-serve-check`). docs/serving.md has the figures."""
