"""A training step with the gradient all-reduce behind backprop: the FIFO communication thread of
torus.integrations.keras (buckets.py, torus.runtime.progress; PyTorch DDP's scheme: Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 13(12), section 3.2.3), priced with the
simulator's replay of the real schedules.

Model (issue 25, times in seconds from the step's start): bucket ``i`` (thread order) is ready at ``r_i``
(profile.py) and its all-reduce takes ``T_i``; one thread runs them in order, so

    s_i = max(r_i, f_{i-1}),   f_i = s_i + T_i,   f_{-1} = 0

and with ``B = max_i r_i`` (backprop's end), ``A`` the apply tail and ``T_m`` the metric all-reduce

    step (overlap on)  = max(B, f_last) + A + T_m
    step (overlap off) = B + T_fused + A + T_m    (one all-reduce of every bucket's bytes, per dtype)
    compute alone      = B + A
    exposed            = step - compute alone
    overlap fraction   = 1 - exposed / (sum_i T_i + T_m)

Contention (``slowdown``, default 1: none): an all-reduce progresses at ``1/slowdown`` of its rate while
backprop still runs (before ``B``: the thread's CPU shared with compute), at full rate after. Backprop itself
is taken as the profile measured it (with overlap on, it already includes what the thread took from it).

``price(nbytes, dtype, algorithm)`` gives ``T``; ``sim_price`` builds it from ``torus.sim.simulate`` (the
replay of torus' own compiled plans on the layout and costs, ``Cost`` in model.py), so no formula is restated
here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from torus.sim.model import ITEMSIZE, Cost, Layout
from torus.sim.profile import Profile
from torus.sim.simulate import simulate

Price = Callable[[int, str, str], float]


@dataclass(frozen=True)
class StepResult:
    """Seconds: ``step`` with overlap, ``off`` without (fused all-reduce after backprop), ``compute`` alone,
    ``exposed`` (``step - compute``), ``exposed_off``, ``comm`` (the thread's busy time: every bucket's
    all-reduce and the metric's), ``fused`` (the fused all-reduce), ``backprop`` (the last bucket ready);
    ``overlap`` = 1 - exposed / comm; ``starts``/``finishes`` per bucket (seconds from the step's start)."""
    algorithm: str
    step: float
    off: float
    compute: float
    exposed: float
    exposed_off: float
    comm: float
    fused: float
    backprop: float
    overlap: float
    starts: tuple[float, ...]
    finishes: tuple[float, ...]

    def as_dict(self) -> dict:
        return asdict(self)


def fifo(ready, times, backprop: float, slowdown: float = 1.0) -> tuple[list[float], list[float]]:
    """Start and finish (seconds) of each all-reduce on one thread in list order: ``s_i = max(r_i, f_{i-1})``,
    ``f_i = s_i + T_i``, stretched by ``slowdown`` before ``backprop`` (module docstring). Pure."""
    if slowdown < 1:
        raise ValueError(f"step model: slowdown {slowdown} is below 1")
    starts, finishes, f = [], [], 0.0
    for r, t in zip(ready, times):
        s = max(r, f)
        window = max(0.0, backprop - s)  # time this all-reduce shares the CPU with backprop
        f = s + t * slowdown if t * slowdown <= window else s + window + (t - window / slowdown)
        starts.append(s)
        finishes.append(f)
    return starts, finishes


def _fused(profile: Profile, price: Price, algorithm: str) -> float:
    """Seconds of the overlap-off all-reduce: one fused buffer per dtype of every bucket's bytes, in turn."""
    per_dtype: dict[str, int] = {}
    for b in profile.buckets:
        per_dtype[b.dtype] = per_dtype.get(b.dtype, 0) + b.nbytes
    return sum(price(n, d, algorithm) for d, n in per_dtype.items())


def model(profile: Profile, price: Price, algorithm: str | None = None, slowdown: float = 1.0) -> StepResult:
    """The step with and without overlap for ``profile``, each all-reduce priced by ``price`` with
    ``algorithm`` (None: each bucket's own from the profile; the metric's and the fused ones then take the
    first bucket's). Raises ValueError where a bucket names no algorithm and none is given, or a price is
    negative."""
    algos = [algorithm or b.algorithm for b in profile.buckets]
    missing = [k for k, a in enumerate(algos) if not a]
    if missing:
        raise ValueError(f"step model: buckets {missing} name no algorithm; give one (torus-sim --algo)")
    main = str(algos[0])
    times = [price(b.nbytes, b.dtype, str(a)) for b, a in zip(profile.buckets, algos)]
    fused = _fused(profile, price, main)
    metric = price(profile.metric_nbytes, profile.metric_dtype, main) if profile.metric_nbytes else 0.0
    if min(times + [fused, metric]) < 0:
        raise ValueError("step model: a negative all-reduce time")
    B, A = profile.backprop, profile.apply
    starts, finishes = fifo([b.ready for b in profile.buckets], times, B, slowdown)
    step = max(B, finishes[-1]) + A + metric
    off = B + fused + A + metric
    compute = profile.compute
    comm = sum(times) + metric
    exposed = step - compute
    return StepResult(",".join(dict.fromkeys(str(a) for a in algos)), step, off, compute, exposed,
                      off - compute, comm, fused, B, 1 - exposed / comm if comm > 0 else 1.0, tuple(starts),
                      tuple(finishes))


def sim_price(layout: Layout, cost: Cost, method: str = "auto") -> Price:
    """``price(nbytes, dtype, algorithm)``: seconds of ``simulate(algorithm, "allreduce", layout,
    nbytes // itemsize, dtype, cost, method).time`` (memoised per call). ValueError for a size that is not a
    whole number of elements (simulate's own errors otherwise)."""
    memo: dict[tuple[int, str, str], float] = {}

    def price(nbytes: int, dtype: str, algorithm: str) -> float:
        key = (nbytes, dtype, algorithm)
        if key not in memo:
            if dtype not in ITEMSIZE or nbytes % ITEMSIZE[dtype]:
                raise ValueError(f"step model: {nbytes} bytes is not a whole number of {dtype} elements")
            memo[key] = simulate(algorithm, "allreduce", layout, nbytes // ITEMSIZE[dtype], dtype, cost,
                                 method).time
        return memo[key]
    return price


def calibrated(price: Price, profile: Profile, algorithm: str | None, seconds: float) -> Price:
    """``price`` times one factor, chosen so that the fused all-reduce of the profile's bytes (``algorithm``,
    or the first bucket's) takes ``seconds`` (a measured all-reduce alone). ValueError for ``seconds <= 0``."""
    algo = str(algorithm or profile.buckets[0].algorithm)
    predicted = _fused(profile, price, algo)
    if not seconds > 0 or not predicted > 0:
        raise ValueError(f"step model: cannot calibrate a predicted {predicted} s all-reduce to {seconds} s")
    factor = seconds / predicted
    return lambda nbytes, dtype, algo_: price(nbytes, dtype, algo_) * factor
