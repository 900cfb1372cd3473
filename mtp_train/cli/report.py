"""mtp-report: one Markdown page for a pipeline run (what `make demo` leaves under runs/demo/).

  mtp-report runs/demo            # reads train/, clp/, eval/; writes runs/demo/report.md

What the page holds is described in mtp_train/report.py; a stage that has not run yet is listed
as missing, so the page can be written at any point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp_train.errors import MtpError
from mtp_train.report import summary, write_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-report", description=__doc__.split("\n")[0])
    ap.add_argument("run_root", type=Path, help="the directory holding train/, clp/ and eval/")
    args = ap.parse_args(argv)
    try:
        path = write_report(args.run_root)
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}\n{summary(args.run_root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
