"""The algorithm registry (torus/schedules/registry.py): the built-ins in the agreement signature's order, and a
toy algorithm registered in the registry alone (tests/mpi/toy_algorithm.py) seen by torus-bench ``--algo``,
torus-sim's choices and table, ``TORUS_ALGO`` and the agreement signature. tests/mpi/test_registry_toy.py runs it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torus
from torus import agreement, select
from torus.schedules import registry
from torus.sim import cli as sim_cli
from torus.sim import closed_form
from torus.sim.model import Cost, Layout

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
import toy_algorithm  # noqa: E402


@pytest.fixture
def toy():
    entry = toy_algorithm.register()
    yield entry
    registry.unregister(toy_algorithm.NAME)


def test_builtins_keep_the_signature_order():
    assert registry.names()[:len(registry.BUILTIN)] == torus.ALGORITHMS == select.ALGORITHMS == (
        "ring", "hierarchical", "torus2d", "native", "shm", "swing", "swing_latency")
    assert [registry.index(a) for a in torus.ALGORITHMS] == list(range(7))
    assert [a for a in torus.ALGORITHMS if registry.get(a).build is None] == ["native", "shm"]
    assert registry.for_collective("allreduce") == torus.ALGORITHMS
    assert "swing_latency" not in registry.for_collective("reduce_scatter")
    assert all(registry.get(a).description for a in torus.ALGORITHMS)


def test_register_refuses_a_duplicate_or_a_bad_name():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Algorithm("ring", "again"))
    with pytest.raises(ValueError, match="identifier"):
        registry.register(registry.Algorithm("a,b", "a list item"))
    with pytest.raises(ValueError, match="needs a plan builder"):
        registry.register(registry.Algorithm("planless", "no plan"))
    with pytest.raises(ValueError, match="built in"):
        registry.unregister("ring")
    with pytest.raises(KeyError, match="unknown algorithm 'butterfly'"):
        registry.get("butterfly")


def test_toy_is_appended(toy):
    assert registry.names()[-1] == toy_algorithm.NAME and registry.index(toy_algorithm.NAME) == 7
    assert toy_algorithm.NAME in registry.for_collective("allgather")
    sig = agreement.signature("allreduce", toy_algorithm.NAME, "sum", torus.DTYPES[0], 5, None, 0, 1)
    assert sig[agreement.SIGNATURE.index("algorithm")] == 7


def test_toy_in_torus_bench_choices(toy):
    from torus.bench import cli as bench_cli
    ap = bench_cli.parser()
    assert ap.parse_args(["allreduce", "--algo", f"ring,{toy_algorithm.NAME}"]).algo == ["ring", toy_algorithm.NAME]
    assert toy_algorithm.NAME in ap.parse_args(["allgather"]).algo  # the default: every algorithm
    assert toy_algorithm.NAME in ap.format_help()
    registry.unregister(toy_algorithm.NAME)
    with pytest.raises(SystemExit):
        bench_cli.parser().parse_args(["allreduce", "--algo", toy_algorithm.NAME])


def test_toy_accepted_as_torus_algo(toy, monkeypatch):
    monkeypatch.setenv("TORUS_ALGO", toy_algorithm.NAME)
    assert select.choose("reduce_scatter", 4, 4, (2, 2)) == toy_algorithm.NAME
    registry.unregister(toy_algorithm.NAME)
    with pytest.raises(ValueError, match="TORUS_ALGO='reverse_ring'"):
        select.choose("reduce_scatter", 4, 4, (2, 2))


def test_toy_in_torus_sim_table(toy, capsys):
    assert toy_algorithm.NAME in sim_cli.parser().format_help()
    code = sim_cli.main(["--algo", f"ring,{toy_algorithm.NAME}", "--ranks", "5", "--nbytes", "4K,1M",
                         "--collective", "allreduce,reduce_scatter,allgather"])
    assert code == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    toy_rows = [r for r in rows if r[0] == toy_algorithm.NAME]
    assert len(toy_rows) == 6
    # the same ring in the other direction: the ring's steps, bytes and time on a star of single-port ranks
    ring_rows = {tuple(r[1:5]): r for r in rows if r[0] == "ring"}
    for r in toy_rows:
        assert r[5:13] == ring_rows[tuple(r[1:5])][5:13], r
        assert r[13] == "full"  # no orbit: every rank replayed
    assert int(toy_rows[0][5]) == closed_form.steps("ring", "allreduce", 5)


def test_toy_has_no_closed_form_unless_given(toy):
    with pytest.raises(ValueError, match="no closed form"):
        closed_form.steps(toy_algorithm.NAME, "allreduce", 4)


def test_toy_simulated_without_mismatch(toy):
    from torus.sim import simulate
    layout = Layout(2, 3, 1)
    for coll in ("allreduce", "reduce_scatter", "allgather"):
        r = simulate(toy_algorithm.NAME, coll, layout, 1001, "float32", Cost(1e-6, 1e-9, 1e-10))
        assert r.tag_mismatches == 0 and r.method == "full"


def test_toy_accepted_by_torus_strategy(toy):
    pytest.importorskip("tensorflow")
    from torus.integrations.keras.strategy import TorusStrategy
    TorusStrategy(algorithm=toy_algorithm.NAME, abort_on_exception=False)
    registry.unregister(toy_algorithm.NAME)
    with pytest.raises(ValueError, match="unknown algorithm 'reverse_ring'"):
        TorusStrategy(algorithm=toy_algorithm.NAME, abort_on_exception=False)


def test_toy_in_torus_train_choices(toy):
    from torus.integrations.keras.app import cli as train_cli  # argparse only: TensorFlow is imported later
    assert train_cli.parser().parse_args(["--algorithm", toy_algorithm.NAME]).algorithm == toy_algorithm.NAME
    registry.unregister(toy_algorithm.NAME)
    with pytest.raises(SystemExit):
        train_cli.parser().parse_args(["--algorithm", toy_algorithm.NAME])
