"""mtp-export-heads: turn a training checkpoint into heads.safetensors + heads.json.

  mtp-export-heads runs/my_run                          # <run>/checkpoints/last.ckpt
  mtp-export-heads runs/my_run --checkpoint path/to/ckpt

A DeepSpeed run leaves `last.ckpt` as a directory of ZeRO shards (one per rank); this gathers them
with DeepSpeed's own consolidation, keeps only the heads, and writes the same files `mtp-train`
writes at the end of a run, so `mtp-clp` and `mtp-eval` take the run directory as it is. A plain
Lightning checkpoint file (DDP, one process) works too. The recipe comes from `<run>/run_config.yaml`
(else `<run>/.hydra/config.yaml`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp_train.errors import MtpError
from mtp_train.pipeline.export import export_heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtp-export-heads", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="an mtp-train run directory")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint file or ZeRO directory (default <run>/checkpoints/last.ckpt)")
    args = parser.parse_args(argv)
    try:
        print(export_heads(args.run_dir, args.checkpoint))
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
