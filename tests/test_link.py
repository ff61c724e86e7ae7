"""torus.link.told: the link speed given by argument or TORUS_LINK_GBITS, and its errors (the measurement
runs across hosts: tests/cluster/cluster_nodes.py)."""
import pytest

from torus import link


def test_told_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv("TORUS_LINK_GBITS", raising=False)
    assert link.told() is None
    assert link.told(2.5) == 2.5
    monkeypatch.setenv("TORUS_LINK_GBITS", "10")
    assert link.told() == 10.0
    assert link.told(1) == 1.0  # the argument wins


@pytest.mark.parametrize("bad", ["fast", "0", "-1", "nan"])
def test_told_rejects_what_is_no_speed(monkeypatch, bad):
    monkeypatch.setenv("TORUS_LINK_GBITS", bad)
    with pytest.raises(ValueError, match="Gbit/s"):
        link.told()
