"""torus-bench: nccl-tests-style sweep of torus' collectives over message sizes and algorithms.

    mpiexec -n 4 torus-bench allreduce -b 4 -e 64M -f 4 --algo torus2d,ring,native --plot busbw.png

Rank 0 prints nccl-tests' columns (size, count, type, redop, then time, algbw, busbw and #wrong out of place
and in place) with an algorithm column, then each algorithm's time over native's at each size. Every argument
is checked before the sweep starts: a bad one is one line from rank 0 and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from torus import cli
from torus.bench import report
from torus.bench.sweep import COLLECTIVES, moved_sizes, parse_size, size_steps, sweep
from torus.ops import DTYPES, OPS
from torus.schedules import registry

_DTYPES = {str(d): d for d in DTYPES}


def _choices() -> tuple:
    """Every registered algorithm (torus/schedules/registry.py, read now) and ``auto``."""
    return (*registry.names(), "auto")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _algorithms(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    choices = _choices()
    bad = [a for a in names if a not in choices]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(bad) or repr(text)}; expected a "
                                         f"comma-separated list of {', '.join(choices)}")
    return list(dict.fromkeys(names))


def _dims(text: str) -> tuple[int, int]:
    try:
        return cli.parse_dims(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected XxY with X, Y >= 1, e.g. 2x2") from None


def parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="torus-bench", description=__doc__)
    ap.add_argument("collective", choices=COLLECTIVES, help="which collective to time")
    ap.add_argument("-b", "--minbytes", type=_size, metavar="SIZE", default="4",
                    help="smallest size in bytes (K, M, G: binary)")
    ap.add_argument("-e", "--maxbytes", type=_size, metavar="SIZE", default="64M",
                    help="largest size in bytes (K, M, G: binary)")
    ap.add_argument("-f", "--stepfactor", type=int, metavar="F", default=2, help="multiply the size by this each step")
    ap.add_argument("-n", "--iters", type=int, metavar="N", default=20, help="timed iterations per size and placement")
    ap.add_argument("-w", "--warmup_iters", type=int, metavar="N", default=5, help="untimed iterations before timing")
    ap.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                    help="1: count wrong elements against the closed-form result (one untimed call); 0: skip")
    ap.add_argument("-d", "--datatype", choices=tuple(_DTYPES), default="float32", help="element type")
    ap.add_argument("-o", "--op", choices=OPS, default="sum", help="reduction (ignored by allgather)")
    ap.add_argument("--algo", type=_algorithms, metavar="LIST", default=",".join(_choices()),
                    help=f"comma-separated algorithms, in table order, from {', '.join(_choices())}")
    ap.add_argument("--dims", type=_dims, metavar="XxY", default=None,
                    help="grid XxY with X*Y = the rank count (default: MPI_Dims_create's)")
    ap.add_argument("--alloc", action="store_true",
                    help="all-reduce into buffers from TorusComm.alloc (shared memory; in place: the Keras path's "
                    "fused gradient buffer, reduced with no copy in); every rank on one node")
    ap.add_argument("--json", metavar="FILE", help="write every figure and the environment as JSON")
    ap.add_argument("--csv", metavar="FILE", help="write every figure as CSV (environment in # lines)")
    ap.add_argument("--plot", metavar="FILE.png", help="draw busbw against size, one line per algorithm "
                    "(needs matplotlib: pip install 'torus[bench]')")
    ap.add_argument("--debug", action="store_true", help="print every failing rank's traceback")
    return ap


def _check(ap, args, size: int) -> None:
    """Every check that needs no communication, so a bad argument fails before the sweep (exit status 2)."""
    dtype = _DTYPES[args.datatype]
    if args.op == "avg" and dtype.kind == "i" and args.collective != "allgather":
        ap.error(f"-o avg is not defined for {dtype}")
    if args.alloc and args.collective != "allreduce":
        ap.error("--alloc is for allreduce (alloc buffers serve in-place all-reduces)")
    if args.iters < 1 or args.warmup_iters < 0:
        ap.error("need -n >= 1 and -w >= 0")
    if args.dims is not None and args.dims[0] * args.dims[1] != size:
        x, y = args.dims
        ap.error(f"--dims {x}x{y}: {x * y} ranks, but this job has {size}")
    for flag in ("json", "csv", "plot"):
        problem = cli.writable_file(f"--{flag}", getattr(args, flag))
        if problem:
            ap.error(problem)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib (pip install matplotlib)")


def main(argv=None) -> int:
    """Run the sweep on every rank; rank 0 prints and writes. Returns 1 if any element was wrong."""
    from mpi4py import MPI
    ap = parser()
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    _check(ap, args, world.Get_size())
    try:
        steps = size_steps(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as e:
        ap.error(str(e))
    dtype = _DTYPES[args.datatype]

    from torus import TorusComm
    try:
        tc = cli.agree(world, "torus-bench: TorusComm", lambda: TorusComm(dims=args.dims), debug=args.debug)
    except cli.JobError as e:
        return cli.report(world, "torus-bench", e)
    cli.abort_on_error(world, "torus-bench", args.debug)
    if tc.topology.nodes > 1:  # shared memory serves one node: refused up front, or left out of the default list
        if args.alloc or args.algo != _algorithms(ap.get_default("algo")) and "shm" in args.algo:
            ap.error(f"{'--alloc' if args.alloc else '--algo shm'} needs every rank on one node; these "
                     f"{tc.size} ranks are on {tc.topology.nodes} nodes")
        args.algo = [a for a in args.algo if a != "shm"]
    sizes = moved_sizes(args.collective, steps, dtype.itemsize, tc.size)
    op = args.op if args.collective != "allgather" else "none"
    settings = {"collective": args.collective, "sizes": sizes, "algorithms": args.algo, "dtype": str(dtype),
                "op": op, "iters": args.iters, "warmup": args.warmup_iters, "check": bool(args.check),
                "alloc": args.alloc}
    env = report.environment(tc, ["torus-bench", *(sys.argv[1:] if argv is None else argv)])
    lead = tc.rank == 0
    if lead:
        print("\n".join(report.header(env, settings)), flush=True)
    rows = []
    for row in sweep(tc, args.collective, sizes, args.algo, dtype=dtype, op=args.op, iters=args.iters,
                     warmup=args.warmup_iters, check=bool(args.check), alloc=args.alloc):
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
