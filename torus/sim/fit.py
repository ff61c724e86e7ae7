"""``torus-sim --fit`` and ``--validate``: α, β, γ measured on this machine, and the model checked against
measured ``TorusComm.allreduce`` times.

``--fit`` (``mpiexec -n K``): α and β by least squares on the time of one ring exchange step, every rank at
once; γ as the slope of ``torus.kernels.reduce_into`` time over bytes reduced, every rank at once; and
``alpha_executor``, the per-step cost of a tiny ring all-reduce through ``TorusComm``. Across nodes also
``inter_alpha``/``inter_beta`` on the node leaders' ring (``fit_link``); on one node, or within every node at
once on equal nodes, the shared-memory transport's ``copy_beta``, ``flag_alpha``, ``call_alpha`` and
``window_beta``.

``--validate`` (``mpiexec -n K``, with ``--params`` from a ``--fit`` at the same K): for each algorithm and
size, the median of the slowest rank's ``TorusComm.allreduce`` time next to ``simulate`` with the fitted
parameters. Both write rank 0's numbers to ``--json``.

Why every rank at once and at the rank count being predicted, and how each constant is timed:
docs/performance.md, "How --fit measures".
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from mpi4py import MPI

from torus import kernels
from torus.bench.sweep import format_size
from torus.comm import TorusComm
from torus.options import machine_ranks
from torus.runtime.shm import SharedMemory
from torus.sim import plans
from torus.sim.model import Cost, Layout
from torus.sim.simulate import simulate

PINGPONG_SIZES = tuple(4 ** k for k in range(1, 13))  # 4 B .. 16 MiB
REDUCE_SIZES = tuple(1 << k for k in range(16, 26, 3))  # 64 KiB .. 32 MiB
VALIDATE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
# Steps of the shm all-reduces that fit flag_alpha and call_alpha (the intercept, at 0 steps): from 257, so that
# even at 2 ranks the buffer (64 B per rank and step) is past any one-step path the transport has for small calls.
SHM_STEPS = (257, 1025, 4097)


def _best_time(fn, reps: int) -> float:
    """The fastest of ``reps`` calls: on a machine shared with other jobs the minimum is the least disturbed
    estimate of the uncontended cost (the median mostly measures the neighbours)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def pingpong(comm, sizes=PINGPONG_SIZES, reps: int = 50) -> list[tuple[int, float]]:
    """(bytes, seconds one way) between ranks 0 and 1; other ranks idle. Collective over ``comm``."""
    rank = comm.Get_rank()
    out = []
    for n in sizes:
        buf = np.ones(n, np.uint8)
        comm.Barrier()
        if rank > 1:
            continue
        peer = 1 - rank

        def once():
            if rank == 0:
                comm.Send(buf, peer, 7)
                comm.Recv(buf, peer, 7)
            else:
                comm.Recv(buf, peer, 7)
                comm.Send(buf, peer, 7)
        once()
        out.append((n, _best_time(once, max(3, reps if n < 1 << 20 else reps // 4)) / 2))
    return out


def exchange(comm, sizes=PINGPONG_SIZES, reps: int = 50, stat=np.median) -> list[tuple[int, float]]:
    """(bytes, seconds) of one ring exchange step, every rank sending to ``rank + 1`` and receiving from
    ``rank - 1`` at once; per size the slowest rank's ``stat`` (median: under oversubscription the typical
    step, not the luckiest one) over ``reps`` steps. Collective over ``comm``; every rank gets the list."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    out = []
    for n in sizes:
        sbuf, rbuf = np.ones(n, np.uint8), np.empty(n, np.uint8)
        comm.Sendrecv(sbuf, right, 7, rbuf, left, 7)
        out.append((n, _slowest(comm, lambda: comm.Sendrecv(sbuf, right, 7, rbuf, left, 7),
                                max(3, reps if n < 1 << 20 else reps // 4), stat)))
    return out


def _slowest(comm, fn, reps: int, stat=np.median) -> float:
    """Every rank calls ``fn`` ``reps`` times, each after a barrier; the largest over ranks of each rank's
    ``stat`` of its times (seconds). Collective over ``comm``."""
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return comm.allreduce(float(stat(times)), op=MPI.MAX)


def fit_alpha_beta(points) -> tuple[float, float]:
    """Least squares of ``t = α + β·b`` with residuals relative to ``t``; both clipped at zero."""
    b = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    A = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def fit_link(points) -> tuple[float, float]:
    """``(α, β)`` of a link between nodes: α the smallest message's time, β the largest message's time past
    α per byte. Not least squares: a shaped link (``tc tbf``, a switch's buffers) passes messages below its
    burst size faster than its rate, and a fit across sizes then takes that burst for bandwidth (it did on the
    emulated cluster: docs/performance.md, "The cost model")."""
    (b0, t0), (b1, t1) = min(points), max(points)
    return max(float(t0), 0.0), max(float(t1 - t0) / (b1 - b0), 0.0) if b1 > b0 else 0.0


def reduce_rate(sizes=REDUCE_SIZES, reps: int = 10, comm=None) -> tuple[float, list]:
    """γ (s per byte reduced) as the least-squares slope of reduce_into time over bytes; and the points.

    With ``comm`` every rank of it reduces at the same time (collective) and each point is the slowest rank's
    median; without, this rank alone, fastest of ``reps``."""
    pts = []
    for n in sizes:
        acc, src = np.ones(n // 4, np.float32), np.ones(n // 4, np.float32)
        kernels.reduce_into(acc, src, "sum")
        once = lambda: kernels.reduce_into(acc, src, "sum")  # noqa: E731
        pts.append((n, _best_time(once, reps) if comm is None else _slowest(comm, once, reps)))
    slope = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0]
    return max(float(slope), 0.0), pts


def copy_rate(comm, sizes=REDUCE_SIZES, reps: int = 10, slot: int = 256 << 10) -> tuple[float, list]:
    """``copy_beta`` (s per byte copied) as the least-squares slope over bytes of copying a buffer of each size
    ``slot`` bytes at a time into one slot-sized buffer with ``np.copyto``, every rank of ``comm`` at once (each
    point the slowest rank's median); and the points. Collective. Piece by piece because that is how the
    transport copies: one side is the caller's buffer, the other a window slot that stays in cache (copying
    whole out-of-cache buffers was much slower and over-predicted shm's times: docs/performance.md)."""
    pts = []
    for n in sizes:
        src, hot = np.ones(n, np.uint8), np.empty(min(slot, n), np.uint8)

        def once(src=src, hot=hot):
            for lo in range(0, src.size, hot.size):
                np.copyto(hot[:min(hot.size, src.size - lo)], src[lo:lo + hot.size])
        once()
        pts.append((n, _slowest(comm, once, reps)))
    slope = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0]
    return max(float(slope), 0.0), pts


def window_copy_rate(comm, sizes=REDUCE_SIZES, reps: int = 10) -> tuple[float, list]:
    """``window_beta`` (s per byte copied, sim/shm.py) as the least-squares slope over bytes of ``np.copyto``
    from one whole buffer of each size into another, every rank of ``comm`` at once (each point the slowest
    rank's median); and the points. Collective. Whole buffers, because that is how ``run_window`` copies a
    peer's reduced chunk from its buffer into ours: the source from memory, the destination read for ownership
    and written back (``copy_rate``'s slot stays in cache instead)."""
    pts = []
    for n in sizes:
        src, dst = np.ones(n, np.uint8), np.ones(n, np.uint8)
        once = lambda src=src, dst=dst: np.copyto(dst, src)  # noqa: E731
        once()
        pts.append((n, _slowest(comm, once, reps)))
    slope = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0]
    return max(float(slope), 0.0), pts


def shm_flags(comm, copy_beta: float, gamma: float, steps=SHM_STEPS, iters: int = 40,
              host_ranks: int | None = None) -> tuple:
    """``(flag_alpha, call_alpha, points)`` of the shared-memory transport (sim/shm.py): in-place float32
    all-reduces of ``k`` steps (``steps``) with 64-byte pieces; the least-squares line of time over ``k`` has
    slope ``2·flag_alpha`` plus the pieces' modelled copies and reduction, and intercept ``call_alpha``.
    Collective over ``comm`` (every rank on one node); ``host_ranks``: the ranks on this machine where more
    than ``comm``'s share it (nodes emulated on one machine), which the transport's spin rule counts."""
    P = comm.Get_size()
    transport = SharedMemory(comm, comm.Get_rank(), P, 64 * P, None, host_ranks=host_ranks)
    pts = []
    for k in steps:
        buf = np.ones(k * 16 * P, np.float32)  # k steps of 64-byte pieces per rank
        call = lambda buf=buf: transport.run("torus-sim --fit", "allreduce", buf, buf, None, "sum", 1.0, False)  # noqa: E731
        call()
        pts.append((k, _median_slowest(comm, call, iters)))
    transport.free()
    slope, intercept = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    piece = 64.0
    flag = (slope - (2 * (P - 1) * copy_beta + (P - 1) * gamma) * piece) / 2
    return max(float(flag), 0.0), max(float(intercept), 0.0), pts


def measure_allreduce(tc, algorithm: str, nbytes: int, iters: int = 20, alloc: bool = False) -> float:
    """Median over ``iters`` calls of the slowest rank's time for one float32 in-place all-reduce of ``nbytes``
    (``alloc``: of a ``TorusComm.alloc`` buffer, freed after; collective)."""
    buf = tc.alloc(nbytes // 4, np.float32) if alloc else np.empty(nbytes // 4, np.float32)
    buf.fill(1)
    tc.allreduce(MPI.IN_PLACE, buf, algorithm=algorithm)
    seconds = _median_slowest(tc.comm, lambda: tc.allreduce(MPI.IN_PLACE, buf, algorithm=algorithm), iters)
    if alloc:
        tc.free_alloc(buf)
    return seconds


def _median_slowest(comm, fn, iters: int) -> float:
    """The median over ``iters`` calls of ``fn``, each after a barrier, of the slowest rank's time (seconds):
    a collective's time. Collective over ``comm``."""
    times = []
    for _ in range(iters):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return float(np.median(times))


def inter_node_exchange(tc, sizes=PINGPONG_SIZES, reps: int = 50) -> list[tuple[int, float]]:
    """``exchange`` among the node leaders (local rank 0) of ``tc``, one flow per node link, the other ranks
    idle: the link as the hierarchical schedule's middle step uses it. Collective over ``tc``; every rank
    gets the list."""
    leaders = tc.comm.Split(0 if tc.local_rank == 0 else MPI.UNDEFINED, tc.rank)
    # the fastest exchange: what the link allows, least disturbed by the other jobs on the CPUs it shares
    points = exchange(leaders, sizes, reps, stat=np.min) if leaders != MPI.COMM_NULL else None
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    # the idle ranks wait asleep: MPI's blocking wait spins, and on hosts that share cores (emulated ones)
    # that spinning took the CPU the leaders' TCP needed (their 16 MiB exchange at half the link's rate)
    done = tc.comm.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)
    return tc.comm.bcast(points, root=0)


def layout_of(tc) -> Layout:
    """The simulator's layout of ``tc``: its grid and its nodes, in any placement."""
    X, Y = tc.dims
    return Layout.placed(X, Y, tc.topology.node_of)


def validate(tc, costs: dict, sizes=VALIDATE_SIZES, algorithms=None, iters: int = 20,
             alloc: bool = False) -> list[dict]:
    """Measured all-reduce times on ``tc`` (a TorusComm) of ``algorithms`` (default torus-sim's default list,
    ``plans.default()``: the registry's ``sim_default`` entries) and, for each ``{name: Cost}``, the simulator's
    prediction ``predicted_<name>`` on ``tc``'s nodes (``layout_of``), phased as ``tc`` runs its calls
    (``TorusComm.shm_phases``); ``alloc``: then shm once more on
    ``TorusComm.alloc`` buffers (rows with ``alloc`` true; every rank on one node). Collective."""
    X, Y = tc.dims
    layout = layout_of(tc)
    algorithms = plans.default() if algorithms is None else algorithms
    rows = []
    for algo, window in [(a, False) for a in algorithms] + ([("shm", True)] if alloc else []):
        for n in sizes:
            row = {"ranks": tc.size, "dims": f"{X}x{Y}", "algorithm": algo, "alloc": window, "nbytes": n,
                   "measured": measure_allreduce(tc, algo, n, iters, window)}
            for name, cost in costs.items():
                if algo == "shm":  # priced at the transport's own slot, not the executor's segment
                    cost = dataclasses.replace(cost, segment_bytes=tc._shm.slot_bytes)
                row[f"predicted_{name}"] = simulate(algo, "allreduce", layout, n // 4, "float32", cost,
                                                    alloc=window, shm_phases=tc.shm_phases).time
            rows.append(row)
    return rows


def executor_alpha(tc, iters: int = 200) -> float:
    """Seconds per step of a ring all-reduce of one element per rank through TorusComm: α as the executor
    pays it (MPI latency plus the Python work of a step), for the size-independent part of the model."""
    return measure_allreduce(tc, "ring", 4 * tc.size, iters) / (2 * (tc.size - 1))


def main(args, cost: Cost) -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        print("torus-sim --fit/--validate: run under mpiexec with at least 2 ranks")
        return 2
    kernels.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # as TorusComm on one node
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    if args.fit:
        tc = TorusComm(check=False)
        # within a node: every node's ranks exchange along their own ring at once (all ranks when one node)
        points = exchange(tc.local_comm if tc.nodes > 1 and tc.local_size > 1 else comm)
        inter = inter_node_exchange(tc) if tc.nodes > 1 else None
        gamma, reduce_pts = reduce_rate(comm=comm)
        alpha_exec = executor_alpha(tc)
        nodes, per_node = tc.nodes, tc.local_size
        # the shared-memory constants on one node, or within every node at once (the node-level phases)
        node_comm = comm if nodes == 1 else tc.local_comm.Dup() if tc.topology.node_grid and per_node > 1 \
            else None
        host_ranks = machine_ranks(comm)
        tc.Free()
        shm_fit: dict = {}
        if node_comm is not None:
            copy_beta, copy_pts = copy_rate(node_comm)
            window_beta, window_pts = window_copy_rate(node_comm)
            flag, call, flag_pts = shm_flags(node_comm, copy_beta, gamma, host_ranks=host_ranks)
            if node_comm is not comm:
                node_comm.Free()
            shm_fit = {"copy_beta": copy_beta, "flag_alpha": flag, "call_alpha": call, "window_beta": window_beta,
                       "copy": copy_pts, "window_copy": window_pts, "shm_steps": flag_pts}
        if rank == 0:
            alpha, beta = fit_alpha_beta(points)
            fitted: dict = {"alpha": alpha, "beta": beta, "gamma": gamma, "alpha_executor": alpha_exec,
                            "ranks": size, "nodes": nodes, "ranks_per_node": per_node, "load": load,
                            "exchange": points, "reduce": reduce_pts, **shm_fit}
            levels = [("within a node" if inter else "", points, alpha, beta)]
            if inter:
                ia, ib = fit_link(inter)
                fitted.update(inter_alpha=ia, inter_beta=ib, inter_exchange=inter)
                levels.append(("between nodes (leaders only)", inter, ia, ib))
            print(f"# {size} ranks on {nodes} node(s), every rank exchanging with its ring neighbours at once; "
                  f"{load}")
            for label, pts, a, b in levels:
                print(f"{'bytes':>9} {'step us':>11} {'fit us':>9}  {label}")
                for n, t in pts:
                    print(f"{format_size(n):>9} {t * 1e6:>11.2f} {(a + b * n) * 1e6:>9.2f}")
            print(f"alpha = {alpha:.3e} s   beta = {beta:.3e} s/B ({1e-9 / beta if beta else float('inf'):.2f}"
                  f" GB/s)   gamma = {gamma:.3e} s/B ({1e-9 / gamma if gamma else float('inf'):.2f} GB/s)   "
                  f"alpha_executor = {alpha_exec:.3e} s per TorusComm ring step")
            if inter:
                print(f"inter_alpha = {ia:.3e} s   inter_beta = {ib:.3e} s/B "
                      f"({1e-9 / ib if ib else float('inf'):.3f} GB/s)")
            if shm_fit:
                cb = shm_fit["copy_beta"]
                print(f"shm: copy_beta = {cb:.3e} s/B ({1e-9 / cb if cb else float('inf'):.2f} GB/s, np.copyto "
                      f"by 256 KiB slots, every rank at once)   flag_alpha = {shm_fit['flag_alpha']:.3e} s   "
                      f"call_alpha = {shm_fit['call_alpha']:.3e} s (shm all-reduces of "
                      f"{', '.join(map(str, SHM_STEPS))} 64-byte steps)")
                wb = shm_fit["window_beta"]
                print(f"shm alloc: window_beta = {wb:.3e} s/B ({1e-9 / wb if wb else float('inf'):.2f} GB/s, "
                      "np.copyto between two whole buffers, every rank at once)")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(fitted, f, indent=1)
        return 0
    tc = TorusComm(check=False)
    slots = [t.slot_bytes for t in tc._executor.shm.values()]  # the node-level transports' (phased calls)
    costs = {"fit": Cost(**{**cost.__dict__, "segment_bytes": tc.segment_bytes,
                            "shm_slot_bytes": max(slots) if slots else None})}
    if args.params:
        with open(args.params) as f:
            params = json.load(f)
        if params.get("ranks", size) != size and rank == 0:
            print(f"# warning: {args.params} was fitted at {params['ranks']} ranks, this run has {size}; "
                  "fit at the rank count you validate (see torus/sim/fit.py)")
        if params.get("alpha_executor") is not None:
            costs["executor"] = Cost(**{**costs["fit"].__dict__, "alpha": params["alpha_executor"]})
    if layout_of(tc).nodes > 1:  # across nodes: also the other link model (model.Cost.shared_links)
        other = "whole" if costs["fit"].shared_links else "shared"
        costs[other] = dataclasses.replace(costs["fit"], shared_links=not costs["fit"].shared_links)
    one_node = tc.nodes == 1
    if args.alloc and not one_node:
        if rank == 0:
            print(f"torus-sim --validate --alloc: alloc buffers need every rank on one node; these ranks are on "
                  f"{tc.nodes}")
        tc.Free()
        return 2
    sizes = VALIDATE_SIZES if args.nbytes_given is None else args.nbytes_given
    algorithms = plans.default() + (("shm",) if one_node else ())
    rows = validate(tc, costs, sizes, algorithms=algorithms, alloc=args.alloc)
    if rank == 0:
        print(f"# {size} ranks, {tc.dims[0]}x{tc.dims[1]}, {layout_of(tc).nodes} node(s) in the model, {load}; "
              f"predicted with {costs}")
        print(f"{'algorithm':>12} {'size':>6} {'measured ms':>12}"
              + "".join(f" {'pred ' + k + ' ms':>18} {'ratio':>6}" for k in costs))
        for r in rows:
            name = r["algorithm"] + (" alloc" if r["alloc"] else "")
            print(f"{name:>12} {format_size(r['nbytes']):>6} {r['measured'] * 1e3:>12.4f}"
                  + "".join(f" {r['predicted_' + k] * 1e3:>18.4f} {r['predicted_' + k] / r['measured']:>6.2f}"
                            for k in costs))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"costs": {k: c.__dict__ for k, c in costs.items()}, "load": load, "rows": rows}, f,
                          indent=1)
    tc.Free()
    return 0
