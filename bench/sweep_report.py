"""Gather a finished `mtp-train -m` sweep (local or SLURM) into one table and one plot.

  python bench/sweep_report.py multirun/<experiment>/<date>

Writes sweep_report.md, sweep_report.json and sweep_report.png (val/sim_tau per heads.k, one line
per loss) into the sweep directory and prints the table. Exit status 1 when a point failed.
"""

import sys

from mtp_train.errors import MtpError
from mtp_train.sweep import markdown_table, report


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        out = report(argv[0])
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(out["points"]))
    print(f"\n{out['ok']} ok, {out['failed']} failed, {out['missing']} missing; plot: {out['plot']}")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
