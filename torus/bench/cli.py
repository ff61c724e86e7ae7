"""torus-bench: nccl-tests-style sweep of torus' collectives over message sizes and algorithms.

    mpiexec -n 4 torus-bench allreduce -b 4 -e 64M -f 4 --algo torus2d,ring,native --plot busbw.png

Rank 0 prints nccl-tests' columns (size, count, type, redop, then time, algbw, busbw and #wrong out of place
and in place) with an algorithm column, then each algorithm's time over native's at each size.
"""
from __future__ import annotations

import argparse
import os
import sys

from torus.bench import report
from torus.bench.sweep import COLLECTIVES, moved_sizes, parse_size, size_steps, sweep
from torus.ops import DTYPES, OPS
from torus.select import ALGORITHMS

_DTYPES = {str(d): d for d in DTYPES}


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _algorithms(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in (*ALGORITHMS, "auto")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {bad}; expected a comma-separated list of "
                                         f"{', '.join((*ALGORITHMS, 'auto'))}")
    return list(dict.fromkeys(names))


def _dims(text: str) -> tuple[int, int]:
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"dims {text!r}: expected XxY, e.g. 2x2") from None
    return x, y


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torus-bench", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("collective", choices=COLLECTIVES)
    ap.add_argument("-b", "--minbytes", type=_size, default=parse_size("4"), help="smallest size (B; K/M/G)")
    ap.add_argument("-e", "--maxbytes", type=_size, default=parse_size("64M"), help="largest size (B; K/M/G)")
    ap.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size and placement")
    ap.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations before timing")
    ap.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                    help="count wrong elements against the closed-form result (one untimed call)")
    ap.add_argument("-d", "--datatype", choices=tuple(_DTYPES), default="float32")
    ap.add_argument("-o", "--op", choices=OPS, default="sum", help="reduction (ignored by allgather)")
    ap.add_argument("--algo", type=_algorithms, default=["ring", "hierarchical", "torus2d", "native", "auto"],
                    help="comma-separated algorithms, in table order")
    ap.add_argument("--dims", type=_dims, default=None, help="grid XxY (default: MPI.Compute_dims)")
    ap.add_argument("--json", metavar="FILE", help="write every figure and the environment as JSON")
    ap.add_argument("--csv", metavar="FILE", help="write every figure as CSV (environment in # lines)")
    ap.add_argument("--plot", metavar="FILE.png", help="draw busbw against size, one line per algorithm")
    return ap


def main(argv=None) -> int:
    """Run the sweep on every rank; rank 0 prints and writes. Returns 1 if any element was wrong."""
    ap = parser()
    args = ap.parse_args(argv)
    dtype = _DTYPES[args.datatype]
    if args.op == "avg" and dtype.kind == "i" and args.collective != "allgather":
        ap.error(f"op avg is not defined for {dtype}")
    if args.iters < 1 or args.warmup_iters < 0:
        ap.error("need -n >= 1 and -w >= 0")
    try:
        steps = size_steps(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as e:
        ap.error(str(e))

    from torus import TorusComm  # after argument errors, which should not need MPI
    tc = TorusComm(dims=args.dims)
    sizes = moved_sizes(args.collective, steps, dtype.itemsize, tc.size)
    op = args.op if args.collective != "allgather" else "none"
    settings = {"collective": args.collective, "sizes": sizes, "algorithms": args.algo, "dtype": str(dtype),
                "op": op, "iters": args.iters, "warmup": args.warmup_iters, "check": bool(args.check)}
    env = report.environment(tc, ["torus-bench", *(sys.argv[1:] if argv is None else argv)])
    lead = tc.rank == 0
    if lead:
        print("\n".join(report.header(env, settings)), flush=True)
    rows = []
    for row in sweep(tc, args.collective, sizes, args.algo, dtype=dtype, op=args.op, iters=args.iters,
                     warmup=args.warmup_iters, check=bool(args.check)):
        rows.append(row)
        if lead:
            print(report.row_line(row), flush=True)
    env["load_average_end"] = list(os.getloadavg())  # other jobs on the machine skew the figures
    if lead:
        print("\n".join(report.summary(rows)), flush=True)
        report.write_all(env, settings, rows, json_path=args.json, csv_path=args.csv, plot_path=args.plot)
    tc.Free()
    wrong = sum(r[p]["wrong"] or 0 for r in rows for p in ("out_of_place", "in_place"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
