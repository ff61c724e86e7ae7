"""The overlap knobs: ``TORUS_OVERLAP`` / ``overlap=`` and ``TORUS_BUCKET_BYTES`` / ``bucket_bytes=`` take the
spellings a user types and refuse the rest with a message naming the setting (never a silent default)."""
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("tensorflow")
from torus.integrations.keras.collectives.buckets import BUCKET_BYTES  # noqa: E402
from torus.integrations.keras.collectives.host import resolve_bucket_bytes, resolve_overlap  # noqa: E402
from torus.runtime.progress import threads_ok  # noqa: E402


def comm(nodes: int):
    return SimpleNamespace(rank=3, topology=SimpleNamespace(nodes=nodes))


@pytest.mark.parametrize("text, want", [("0", False), ("off", False), ("FALSE", False), (" no ", False),
                                        ("1", True), ("On", True), ("true", True), ("yes", True)])
@pytest.mark.parametrize("nodes", [1, 2])
def test_spellings_override_the_default(monkeypatch, text, want, nodes):
    monkeypatch.setenv("TORUS_OVERLAP", text)
    assert resolve_overlap(comm(nodes), None) is (want and threads_ok())


@pytest.mark.parametrize("nodes", [1, 2])
def test_default_is_on_across_nodes_only(monkeypatch, nodes):
    monkeypatch.delenv("TORUS_OVERLAP", raising=False)
    assert resolve_overlap(comm(nodes), None) is (nodes > 1 and threads_ok())
    monkeypatch.setenv("TORUS_OVERLAP", "")
    assert resolve_overlap(comm(nodes), None) is (nodes > 1 and threads_ok())


def test_argument_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("TORUS_OVERLAP", "1")
    assert resolve_overlap(comm(2), False) is False


@pytest.mark.parametrize("text", ["2", "maybe", "enabled"])
def test_other_values_are_refused(monkeypatch, text):
    monkeypatch.setenv("TORUS_OVERLAP", text)
    with pytest.raises(ValueError, match=rf"rank 3: TORUS_OVERLAP='{text}': expected 0 or 1"):
        resolve_overlap(comm(2), None)


@pytest.mark.parametrize("value", ["off", 1, "yes"])
def test_non_bool_argument_is_refused(value):
    with pytest.raises(TypeError, match=r"rank 3: overlap="):
        resolve_overlap(comm(2), value)


def test_bucket_bytes(monkeypatch):
    monkeypatch.delenv("TORUS_BUCKET_BYTES", raising=False)
    assert resolve_bucket_bytes(comm(2), None) == BUCKET_BYTES
    assert resolve_bucket_bytes(comm(2), 4096) == 4096
    monkeypatch.setenv("TORUS_BUCKET_BYTES", "65536")
    assert resolve_bucket_bytes(comm(2), None) == 65536
    monkeypatch.setenv("TORUS_BUCKET_BYTES", " 1024\n")
    assert resolve_bucket_bytes(comm(2), None) == 1024
    assert resolve_bucket_bytes(comm(2), 7) == 7


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1e6", "1k", "4096.5", "1_000", "\uff11\uff12\uff13"])
def test_bad_bucket_bytes_variable_is_named(monkeypatch, text):
    monkeypatch.setenv("TORUS_BUCKET_BYTES", text)
    with pytest.raises(ValueError, match=rf"rank 3: TORUS_BUCKET_BYTES='{text}': expected a whole number"):
        resolve_bucket_bytes(comm(2), None)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-5, ValueError), (True, TypeError),
                                          ("4096", TypeError), (4096.7, TypeError)])
def test_bad_bucket_bytes_argument(value, error):
    with pytest.raises(error, match=r"rank 3: bucket_bytes="):
        resolve_bucket_bytes(comm(2), value)


@pytest.mark.parametrize("threads, nodes, asked, warns", [(1, 2, None, True), (1, 1, True, True),
                                                         (1, 1, None, False), (1, 2, False, False),
                                                         (2, 2, None, False), (0, 2, True, False)])
def test_one_inter_op_thread_warns_once_that_nothing_is_hidden(monkeypatch, threads, nodes, asked, warns):
    """Overlap on with TensorFlow's inter-op pool at one thread: one warning per process naming the rank and the
    fix, overlap still on; 0 (TensorFlow's default: one per core) and 2 do not warn, nor overlap off."""
    import tensorflow as tf

    from torus.integrations.keras.collectives import host
    monkeypatch.delenv("TORUS_OVERLAP", raising=False)
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: threads)
    monkeypatch.setattr(host, "_warned_inter_op", [])
    for call in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            on = resolve_overlap(comm(nodes), asked)
        said = [str(w.message) for w in seen if "inter-op" in str(w.message)]
        assert on is (bool(asked if asked is not None else nodes > 1) and threads_ok())
        assert len(said) == (1 if warns and on and call == 0 else 0), said
        if said:
            assert "rank 3" in said[0] and "set_inter_op_parallelism_threads(1)" in said[0] and "2 threads" in said[0]
