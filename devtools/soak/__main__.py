"""`python -m devtools.soak` (scripts/soak.sh): the command line of the soak (docs/testing.md, "Soak")."""

from __future__ import annotations

import argparse
import random
import signal
import sys
from types import FrameType

from devtools.soak import __doc__ as SOAK_DOC
from devtools.soak.run import soak_one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak.sh", description=SOAK_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, required=True, help="how long the faults are injected")
    parser.add_argument("--source", choices=["postgres", "mariadb", "both"], default="both")
    parser.add_argument("--seed", type=int, default=None, help="the scheduler's seed (default: random, printed)")
    parser.add_argument("--format", choices=["delta", "iceberg", "parquet"], default="parquet",
                        help="the consumer's target format (default parquet)")
    parser.add_argument("--fault-pause", type=float, default=11.5, metavar="S",
                        help="mean seconds between fault rounds, each drawn from 0.25 to 1.75 times it (default 11.5: "
                        "3-20 s); a long soak takes a longer pause so the consumer's merges keep up")
    parser.add_argument("--keep", action="store_true", help="keep the work directory after a passing run too")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop everything

    signal.signal(signal.SIGTERM, on_term)
    kinds = ["postgres", "mariadb"] if args.source == "both" else [args.source]
    results = [soak_one(k, seed, args.minutes, args.format, args.keep, args.fault_pause) for k in kinds]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
