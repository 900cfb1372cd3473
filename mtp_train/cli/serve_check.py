"""mtp-serve-check: serve a run's trained heads in a real engine (vLLM's CPU build) and check the
engine's own acceptance counters against our decoder's on the same prompts.

  mtp-serve-check runs/demo-eagle3/train                 # 20 unseen prompts x 48 tokens
  mtp-serve-check RUN --prompts 40 --rounds 3 --out DIR
  mtp-serve-check RUN --tamper aux_layers                # break the export: the check must disagree

The engine lives in its own environment under .cache/engine-env/ (built on first use, tens of
minutes; `make engine-env` builds it ahead). Writes <out>/serve_check.json (default
<run>/serve_check/) and exits 1 when the engine and ours disagree (docs/serving.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mtp_train.errors import MtpError


def main(argv: list[str] | None = None) -> int:
    from mtp_train.engine.check import TAMPERS

    parser = argparse.ArgumentParser(prog="mtp-serve-check", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="an mtp-train run directory with trained heads")
    parser.add_argument("--prompts", type=int, default=20, help="how many prompts (default 20)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompt-source", choices=("unseen", "validation"), default="unseen",
                        help="conversations the run never saw (default), or its validation rows")
    parser.add_argument("--prompts-file", type=Path, default=None, help="a JSONL file of prompts instead")
    parser.add_argument("--rounds", type=int, default=1, help="timing rounds (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="default <run>/serve_check")
    parser.add_argument("--no-build", action="store_true", help="refuse instead of building the engine environment")
    parser.add_argument("--tamper", choices=TAMPERS, default=None,
                        help="break the eagle3 export on purpose (the comparison must catch it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        from mtp_train.engine.check import serve_check, summary_lines

        result = serve_check(args.run_dir, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                             prompt_source=args.prompt_source, prompts_file=args.prompts_file,
                             rounds=args.rounds, out=args.out, build_env=not args.no_build, tamper=args.tamper)
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(result)))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
