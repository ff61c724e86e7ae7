"""algorithm="auto": the table's rows, the grid rule and the TORUS_ALGO override."""
import pytest

from torus.select import ALGORITHMS, ONE_NODE_TABLE, TABLE, choose


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
