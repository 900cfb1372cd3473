"""mtp-export-heads: turn a training checkpoint into heads.safetensors + heads.json, or trained heads
into a serving engine's format.

  mtp-export-heads runs/my_run                          # <run>/checkpoints/last.ckpt
  mtp-export-heads runs/my_run --checkpoint path/to/ckpt
  mtp-export-heads runs/my_run --format eagle3          # vLLM / SGLang (speculators layout)
  mtp-export-heads runs/my_run --format medusa --out served/medusa

A DeepSpeed run leaves `last.ckpt` as a directory of ZeRO shards (one per rank); this gathers them
with DeepSpeed's own consolidation, keeps only the heads, and writes the same files `mtp-train`
writes at the end of a run, so `mtp-clp` and `mtp-eval` take the run directory as it is. A plain
Lightning checkpoint file (DDP, one process) works too. The recipe comes from `<run>/run_config.yaml`.

--format eagle3|medusa reads the run's heads.safetensors + heads.json and writes the engine's layout
to --out (default <run>/export-<format>), with mtp_serving.json naming the backbone to serve with and
the engine command lines (mtp_train/pipeline/serving.py, docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp_train.errors import MtpError
from mtp_train.heads.registry import EXPORT_FORMATS
from mtp_train.pipeline.export import export_heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtp-export-heads", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="an mtp-train run directory")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint file or ZeRO directory (default <run>/checkpoints/last.ckpt)")
    parser.add_argument("--format", choices=EXPORT_FORMATS, default="native",
                        help="native: heads.safetensors + heads.json in the run (from a checkpoint); "
                             "eagle3 / medusa: the serving engines' layouts (from the run's heads)")
    parser.add_argument("--out", type=Path, default=None, help="engine formats: where to write "
                        "(default <run>/export-<format>)")
    args = parser.parse_args(argv)
    try:
        if args.format == "native":
            if args.out is not None:
                raise MtpError("--out: the native format is written into the run directory itself")
            print(export_heads(args.run_dir, args.checkpoint))
        else:
            if args.checkpoint is not None:
                raise MtpError(f"--checkpoint: --format {args.format} exports the run's heads files; "
                               f"write them from a checkpoint first with --format native")
            from mtp_train.pipeline.serving import export_for_engine

            print(export_for_engine(args.run_dir, args.format, args.out))
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a read-only run or destination, a full disk: exports publish atomically
        from mtp_train.cli.common import write_failure

        if (what := write_failure(e)) is None:
            raise
        print(f"error: {what}; nothing half-written was published (free space or fix permissions, then "
              "rerun)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
