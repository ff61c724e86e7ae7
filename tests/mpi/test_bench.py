"""torus-bench: size parsing, the closed-form check, the sweep for every algorithm, and what the CLI writes.

Runs under mpiexec -n K (any K, including 1); about 2-4 s per K on 2 cores (K=6 oversubscribed is the
slowest). No timing is asserted, only how the figures relate to each other.
"""
import csv
import json

import numpy as np
import pytest
from mpi4py import MPI

import torus
from torus.bench import cli
from torus.bench.sweep import PERIOD, count_wrong, fill, format_size, moved_sizes, parse_size, size_steps, sweep

ALL = [*torus.ALGORITHMS, "auto"]


@pytest.fixture(scope="module")
def tc():
    comm = torus.TorusComm()
    yield comm
    comm.Free()


def test_sizes():
    assert [parse_size(s) for s in ("0", "4", "64K", "64k", "256M", "1G", "3KB", " 7 ")] == \
        [0, 4, 65536, 65536, 268435456, 1073741824, 3072, 7]
    for bad in ("", "K", "1T", "-1", "1.5K", "4 K B", "0x10"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert [format_size(n) for n in (0, 4, 1024, 1536, 65536, 3 << 20, 1 << 30)] == \
        ["0", "4", "1K", "1536", "64K", "3M", "1G"]
    assert size_steps(4, 64, 4) == [4, 16, 64]
    assert size_steps(4, 100, 4) == [4, 16, 64]
    assert size_steps(0, 1 << 20, 2) == [0]
    with pytest.raises(ValueError):
        size_steps(8, 4, 2)
    # float32 on 4 ranks: all-reduce needs whole elements, reduce-scatter whole 16-byte rows of blocks.
    assert moved_sizes("allreduce", [4, 6, 100, 1 << 20], 4, 4) == [4, 100, 1 << 20]
    assert moved_sizes("reduce_scatter", [4, 20, 100, 1 << 20], 4, 4) == [0, 16, 96, 1 << 20]
    assert moved_sizes("allgather", [48, 50], 2, 3) == [48]


@pytest.mark.parametrize("dtype", [np.float16, torus.ops.BFLOAT16, np.float64, np.int32])
def test_fill_and_count_wrong(dtype, rng):
    values = rng.integers(-2, 3, PERIOD).astype(np.float64)
    for n, start in ((0, 0), (3, 4), (PERIOD, 2), (1001, 7)):
        buf = np.full(n, 99, dtype)
        fill(buf, values, start)
        ref = values[(start + np.arange(n)) % PERIOD].astype(dtype)
        np.testing.assert_array_equal(buf, ref)
        assert count_wrong(buf, values, start) == 0
        if n:
            bad = rng.choice(n, size=min(n, 3), replace=False)
            buf[bad] += 1
            assert count_wrong(buf, values, start) == bad.size
    if np.dtype(dtype).kind == "f":
        buf = np.zeros(12, dtype)
        fill(buf, values, 0)
        buf[5] = np.nan
        assert count_wrong(buf, values, 0) == 1 and count_wrong(buf, values, 0, tolerance=0.01) == 1


def _check_rows(rows, collective, sizes, algorithms, ranks, iters):
    factor = {"allreduce": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}[collective] * (ranks - 1) / ranks
    assert [(r["size"], r["algorithm"]) for r in rows] == [(s, a) for s in sizes for a in algorithms]
    for r in rows:
        assert r["count"] * np.dtype(r["dtype"]).itemsize == r["size"]
        for p in ("out_of_place", "in_place"):
            s = r[p]
            assert s["wrong"] == 0, (r["size"], r["algorithm"], p, s["wrong"])
            assert len(s["times_us"]) == iters
            assert s["time_us"] == pytest.approx(np.median(s["times_us"]))
            assert s["min_us"] <= s["p25_us"] <= s["time_us"] <= s["p75_us"] <= s["max_us"]
            assert s["algbw"] == pytest.approx(r["size"] / (s["time_us"] * 1e-6) / 1e9)
            assert s["busbw"] == pytest.approx(s["algbw"] * factor)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_sweep_every_algorithm(tc, world, collective):
    sizes = moved_sizes(collective, [4, 1000, 64 << 10], 4, tc.size)
    rows = list(sweep(tc, collective, sizes, ALL, dtype=np.float32, op="sum", iters=2, warmup=0))
    _check_rows(rows, collective, sizes, ALL, tc.size, 2)
    # Every rank holds the same figures (times are the slowest rank's, #wrong is summed over ranks).
    assert world.allgather(json.dumps(rows)) == [json.dumps(rows)] * tc.size


@pytest.mark.parametrize("collective,dtype,op", [
    ("allreduce", np.float16, "avg"), ("reduce_scatter", torus.ops.BFLOAT16, "max"),
    ("allreduce", np.float64, "min"), ("reduce_scatter", np.int32, "prod"), ("allreduce", np.int64, "sum")])
def test_sweep_dtypes_and_ops(tc, collective, dtype, op):
    dtype = np.dtype(dtype)
    sizes = moved_sizes(collective, [1003 * dtype.itemsize], dtype.itemsize, tc.size)
    rows = list(sweep(tc, collective, sizes, ["torus2d", "native"], dtype=dtype, op=op, iters=1, warmup=0))
    _check_rows(rows, collective, sizes, ["torus2d", "native"], tc.size, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_sweep_on_alloc_buffers(tc, dtype):
    """``alloc``: every algorithm's all-reduce into TorusComm.alloc buffers (in place: the window path)
    matches the closed form, and every buffer is freed after its size."""
    if tc.topology.nodes > 1:
        pytest.skip("alloc needs every rank on one node")
    dtype = np.dtype(dtype)
    sizes = moved_sizes("allreduce", [0, 8, 1003 * dtype.itemsize, 100 << 10], dtype.itemsize, tc.size)
    algos = ["auto", "shm", "ring", "native"]
    rows = list(sweep(tc, "allreduce", sizes, algos, dtype=dtype, op="sum", iters=1, warmup=0, alloc=True))
    _check_rows(rows, "allreduce", sizes, algos, tc.size, 1)
    assert not tc._shm._buffers, "every alloc buffer freed"


class _Corrupting:
    """A TorusComm whose all-reduce result is off by one at element 0 on every rank."""

    def __init__(self, tc):
        self._tc = tc

    def __getattr__(self, name):
        return getattr(self._tc, name)

    def allreduce(self, *args, **kwargs):
        out = self._tc.allreduce(*args, **kwargs)
        out.reshape(-1)[0] += 1
        return out


def test_wrong_elements_are_counted(tc):
    rows = list(sweep(_Corrupting(tc), "allreduce", [64], ["ring"], dtype=np.float32, iters=1, warmup=0))
    assert rows[0]["out_of_place"]["wrong"] == rows[0]["in_place"]["wrong"] == tc.size
    rows = list(sweep(_Corrupting(tc), "allreduce", [64], ["ring"], dtype=np.float32, iters=1, warmup=0,
                      check=False))
    assert rows[0]["out_of_place"]["wrong"] is None


def test_cli_table_json_csv_plot(tmp_path, capsys, world):
    paths = {k: str(tmp_path / f"bench.{k}") for k in ("json", "csv", "png")}
    argv = ["allreduce", "-b", "8", "-e", "8K", "-f", "32", "-n", "1", "-w", "0", "--algo", "ring,native",
            "-d", "float64", "--json", paths["json"], "--csv", paths["csv"], "--plot", paths["png"]]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if world.Get_rank() != 0:
        assert out == ""
        return
    lines = out.splitlines()
    assert any("#wrong" in line for line in lines) and "# Out of bounds values : 0 OK" in lines
    table = [line.split() for line in lines if not line.startswith("#")]
    assert [(t[0], t[4]) for t in table[:6]] == [("8", "ring"), ("8", "native"), ("256", "ring"),
                                               ("256", "native"), ("8192", "ring"), ("8192", "native")]
    data = json.load(open(paths["json"]))
    env = data["environment"]
    assert env["ranks"] == world.Get_size() and env["torus"] == torus.__version__
    assert env["mpi_library"].startswith(" ".join(MPI.Get_library_version().splitlines()[0].split()))
    assert {"mpi4py", "dims", "hosts", "env", "command", "date_utc", "load_average", "load_average_end"} <= set(env)
    assert data["arguments"]["sizes"] == [8, 256, 8192] and data["arguments"]["dtype"] == "float64"
    results = data["results"]
    for t, r in zip(table, results):  # the printed table is the JSON, rounded
        assert int(t[0]) == r["size"] and int(t[1]) == r["count"] and t[2] == "float64" and t[3] == "sum"
        assert float(t[8]) == pytest.approx(r["out_of_place"]["busbw"], abs=1e-3)
    with open(paths["csv"]) as f:
        comments = [line for line in f if line.startswith("#")]
        f.seek(0)
        csv_rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert any(c.startswith("# ranks: ") for c in comments)
    assert len(csv_rows) == 2 * len(results)
    for c, (r, p) in zip(csv_rows, [(r, p) for r in results for p in ("out_of_place", "in_place")]):
        assert (int(c["size"]), c["algorithm"], c["placement"]) == (r["size"], r["algorithm"], p)
        assert float(c["busbw"]) == pytest.approx(r[p]["busbw"]) and int(c["wrong"]) == 0
        assert [float(t) for t in c["times_us"].split()] == pytest.approx(r[p]["times_us"], abs=1e-3)
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
