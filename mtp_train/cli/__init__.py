"""Every entry point, one module each (prep, train, clp, eval, export, report), which never import
each other; common.py and sweep.py hold what the Hydra ones share. The only place Hydra is imported."""
