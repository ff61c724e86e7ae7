"""algorithm="auto": the table's rows, the grid rule and the TORUS_ALGO override."""
import pytest

from torus.select import (
    ALGORITHMS,
    NATIVE_LINK_SECONDS,
    ONE_NODE_TABLE,
    RING_MAX_NODES,
    SWING_LINK_SECONDS,
    SWING_MIN_BYTES,
    TABLE,
    TORUS2D_LINK_SECONDS,
    Nodes,
    choose,
)


def _expected(nbytes, size, in_place):
    # An independent reading of the table: the first row whose limits all admit the call.
    for max_size, max_nbytes, where, algo in TABLE:
        if ((max_size is None or size <= max_size) and (max_nbytes is None or nbytes <= max_nbytes)
                and (where is None or where == ("in_place" if in_place else "out_of_place"))):
            return algo


@pytest.mark.parametrize("size,dims", [(2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (6, (2, 3)), (6, (6, 1))])
@pytest.mark.parametrize("nbytes", [0, 4, 32 * 1024, 32 * 1024 + 4, 128 * 1024, 128 * 1024 + 4, 256 * 1024,
                                    256 * 1024 + 4, 512 * 1024, 512 * 1024 + 4, 1 << 20, (1 << 20) + 4,
                                    16 << 20, (16 << 20) + 4, 128 << 20, (128 << 20) + 4, 256 << 20])
@pytest.mark.parametrize("in_place", [False, True])
def test_table(monkeypatch, size, dims, nbytes, in_place):
    monkeypatch.delenv("TORUS_ALGO", raising=False)
    want = _expected(nbytes, size, in_place)
    if want == "torus2d" and 1 in dims:
        want = "ring"
    assert choose("allreduce", nbytes, size, dims, in_place) == want


def test_small_is_native_large_is_a_schedule(monkeypatch):
    monkeypatch.delenv("TORUS_ALGO", raising=False)
    assert choose("allreduce", 4, 4, (2, 2)) == "native"
    assert choose("allreduce", 256 << 20, 4, (2, 2)) == "torus2d"
    assert choose("allreduce", 64 << 20, 4, (2, 2)) == "ring"  # measured: 4 ranks on 2 cores
    assert choose("allreduce", 64 << 20, 6, (2, 3)) == "torus2d"
    assert choose("allreduce", 64 << 10, 2, (1, 2)) == "ring"  # out of place it skips MPI's copy
    assert choose("allreduce", 64 << 10, 2, (1, 2), in_place=True) == "native"
    assert choose("allreduce", 256 << 10, 2, (1, 2), in_place=True) == "ring"
    assert choose("allreduce", 64 << 10, 4, (2, 2)) == "torus2d"
    assert choose("allreduce", 64 << 10, 4, (2, 2), in_place=True) == "native"
    assert choose("allreduce", 64 << 10, 6, (2, 3)) == "native"  # not measured with the C loop
    assert choose("allreduce", 256 << 20, 2, (1, 2)) == "ring"
    assert choose("allgather", 256 << 20, 1, (1, 1)) == "native"


@pytest.mark.parametrize("size,dims", [(2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (6, (2, 3))])
@pytest.mark.parametrize("nbytes", [0, 4, 64 << 10, 1 << 20, (1 << 20) + 4, 256 << 20])
@pytest.mark.parametrize("in_place", [False, True])
def test_one_node_rows_come_first(monkeypatch, size, dims, nbytes, in_place):
    """On one node ONE_NODE_TABLE is read before TABLE; across nodes it never is (shm needs one window)."""
    monkeypatch.delenv("TORUS_ALGO", raising=False)
    across = choose("allreduce", nbytes, size, dims, in_place)
    assert across != "shm"
    want = next((algo for max_size, max_nbytes, where, algo in ONE_NODE_TABLE
                 if size <= max_size and (max_nbytes is None or nbytes <= max_nbytes)), across)
    assert choose("allreduce", nbytes, size, dims, in_place, one_node=True) == want
    assert choose("allreduce", nbytes, 1, (1, 1), in_place, one_node=True) == "native"


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_override(monkeypatch, algo):
    monkeypatch.setenv("TORUS_ALGO", algo)
    assert choose("reduce_scatter", 4, 4, (2, 2)) == algo


def test_bad_override(monkeypatch):
    monkeypatch.setenv("TORUS_ALGO", "butterfly")
    with pytest.raises(ValueError, match="reduce_scatter: TORUS_ALGO='butterfly'"):
        choose("reduce_scatter", 4, 4, (2, 2))


# ---------------------------------------------------------------- across nodes (select.across_nodes)
def _expected_across(collective, nbytes, dims, nodes):
    # The rule read independently: one rank per node, a small all-reduce takes Swing's latency form; the
    # seconds the buffer takes on one link decide MPI's own call; then where the nodes' ranks sit in the grid.
    seconds = nbytes * 8 / (nodes.link_gbits * 1e9)
    if collective == "allreduce" and nodes.ranks_per_node == 1 and nbytes >= SWING_MIN_BYTES and \
            seconds <= SWING_LINK_SECONDS:
        return "swing_latency"
    if nbytes * 8 / (nodes.link_gbits * 1e9) <= NATIVE_LINK_SECONDS:
        return "native"
    line = dims[0] == 1 or dims[1] == 1
    if nodes.ranks_per_node == 1:
        if line:
            return "ring"
        few_steps_matter = nbytes * 8 / (nodes.link_gbits * 1e9) <= TORUS2D_LINK_SECONDS
        return "torus2d" if few_steps_matter or nodes.nodes > RING_MAX_NODES else "ring"
    return "hierarchical" if line or nodes.node_axis is None else "torus2d"


ACROSS = [(2, 2, (2, 2), "row"), (2, 2, (2, 2), "col"), (2, 2, (2, 2), None), (2, 2, (1, 4), "row"),
          (2, 1, (1, 2), None), (4, 1, (2, 2), None), (3, 1, (1, 3), None), (4, 2, (2, 4), "row"),
          (3, 2, (3, 2), "col"), (2, 4, (2, 4), None), (6, 1, (2, 3), None), (8, 1, (1, 8), None)]


@pytest.mark.parametrize("nodes,per_node,dims,axis", ACROSS)
@pytest.mark.parametrize("gbits", [0.5, 1.0, 4.0, 100.0])
@pytest.mark.parametrize("nbytes", [0, 4, 16, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 64 << 20])
def test_across_nodes(monkeypatch, nodes, per_node, dims, axis, gbits, nbytes):
    monkeypatch.delenv("TORUS_ALGO", raising=False)
    across = Nodes(nodes, per_node, axis, gbits)
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        want = _expected_across(collective, nbytes, dims, across)
        for in_place in (False, True):
            assert choose(collective, nbytes, nodes * per_node, dims, in_place, across) == want


def test_across_nodes_swing_latency_where_measured(monkeypatch):
    """One rank per host at 1 Gbit/s: 16 B - 4 KiB all-reduces take swing_latency (measured ahead of native
    there); 4 B, 16 KiB, two ranks per host and the other collectives do not."""
    monkeypatch.delenv("TORUS_ALGO", raising=False)
    one = Nodes(4, 1, None, 1.0)
    assert [choose("allreduce", n, 4, (2, 2), False, one) for n in (4, 16, 4096, 16384)] == \
        ["native", "swing_latency", "swing_latency", "native"]
    assert choose("allreduce", 1024, 8, (2, 4), False, Nodes(4, 2, "row", 1.0)) == "native"
    assert choose("allgather", 1024, 4, (2, 2), False, one) == "native"


def test_across_nodes_native_threshold_grows_with_the_link(monkeypatch):
    monkeypatch.delenv("TORUS_ALGO", raising=False)

    def largest_native(gbits):
        across = Nodes(2, 2, "row", gbits)
        return max(n for n in range(0, 64 << 20, 4096) if choose("allreduce", n, 4, (2, 2), False, across)
                   == "native") if choose("allreduce", 0, 4, (2, 2), False, across) == "native" else -1

    sizes = [largest_native(g) for g in (1.0, 10.0)]
    assert sizes[0] >= 0 and sizes[1] > sizes[0]
    assert choose("allreduce", 64 << 20, 4, (2, 2), False, Nodes(2, 2, "row", 1.0)) == "torus2d"


def test_across_nodes_override(monkeypatch):
    monkeypatch.setenv("TORUS_ALGO", "ring")
    assert choose("allreduce", 64 << 20, 4, (2, 2), False, Nodes(2, 2, "row", 1.0)) == "ring"

