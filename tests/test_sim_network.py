"""The simulator's networks (torus/sim/network.py): routes and link sharing against a brute-force walk, and
replays on a torus and a fat tree against closed forms built independently here."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest

from torus.schedules.swing import rho
from torus.sim import closed_form
from torus.sim.model import Cost, Layout
from torus.sim.network import Network
from torus.sim.simulate import simulate


def _walk(net: Network, nodes: int, a: int, b: int) -> list:
    """The links from node ``a`` to ``b``, hop by hop, with the capacity of each (the module's rules)."""
    if net.kind == "star":
        return [(("out", a), 1.0), (("in", b), 1.0)]
    if net.kind == "fattree":
        mid = [] if a // net.leaf == b // net.leaf else \
            [(("up", a // net.leaf), net.leaf / net.oversubscription),
             (("down", b // net.leaf), net.leaf / net.oversubscription)]
        return [(("out", a), 1.0), *mid, (("in", b), 1.0)]
    dims = net.dims
    coord = list(np.unravel_index(a, dims[::-1])[::-1])
    goal = list(np.unravel_index(b, dims[::-1])[::-1])
    hops = []
    for d, n in enumerate(dims):
        fwd = (goal[d] - coord[d]) % n
        sign = 1 if 2 * fwd <= n else -1
        while coord[d] != goal[d]:
            here = int(np.ravel_multi_index(coord[::-1], dims[::-1]))
            hops.append(((here, d, sign), 1.0))
            coord[d] = (coord[d] + sign) % n
    port = 2.0 * len(dims)
    return [(("out", a), port), *hops, (("in", b), port)]


def _brute(net, nodes, src, dst, sender, receiver, send_step, recv_step):
    flows = defaultdict(set)
    routes = []
    for i in range(len(src)):
        route = _walk(net, nodes, int(src[i]), int(dst[i]))
        routes.append(route)
        for link, _ in route:
            inward = link[0] == "in"
            flows[(recv_step[i] if inward else send_step[i], link)].add(receiver[i] if inward else sender[i])
    out = []
    for i, route in enumerate(routes):
        load = [len(flows[(recv_step[i] if link[0] == "in" else send_step[i], link)]) / cap for link, cap in route]
        out.append(max(1.0, *load))
    return np.array(out)


NETWORKS = [Network(), Network("torus", (7,)), Network("torus", (4, 3)), Network("torus", (3, 2, 4)),
            Network("torus", (6, 6)), Network("fattree", (), 4, 1.0), Network("fattree", (), 3, 3.0),
            Network("fattree", (), 5, 2.5)]


@pytest.mark.parametrize("net", NETWORKS, ids=lambda n: n.name)
@pytest.mark.parametrize("seed", range(4))
def test_slowdown_equals_a_walk_of_every_route(net, seed):
    rng = np.random.default_rng(seed)
    nodes = int(np.prod(net.dims)) if net.kind == "torus" else int(rng.integers(2, 20))
    net.check(nodes)
    m = int(rng.integers(1, 60))
    src = rng.integers(0, nodes, m)
    dst = (src + rng.integers(1, nodes, m)) % nodes  # between nodes only
    sender, receiver = src * 3 + rng.integers(0, 3, m), dst * 3 + rng.integers(0, 3, m)
    send_step, recv_step = rng.integers(0, 3, m), rng.integers(0, 3, m)
    got = net.slowdown(nodes, src, dst, sender, receiver, send_step, recv_step)
    want = _brute(net, nodes, src, dst, sender, receiver, send_step, recv_step)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_one_ranks_messages_of_a_step_are_one_flow():
    # three messages of one sender at one step over the same torus link: one flow, no slowdown
    net = Network("torus", (8,))
    got = net.slowdown(8, [0, 0, 0], [1, 2, 3], [0, 0, 0], [1, 2, 3], [0, 0, 0], [0, 0, 0])
    np.testing.assert_array_equal(got, np.ones(3))
    # the same three from three senders of one node: three flows on link 0 -> 1
    got = net.slowdown(8, [0, 0, 0], [1, 2, 3], [0, 1, 2], [3, 4, 5], [0, 0, 0], [0, 0, 0])
    np.testing.assert_array_equal(got, np.full(3, 3.0))


@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("gamma", [0.0, 3e-11])
def test_swing_on_a_ring_of_nodes_shares_links_as_its_distance_says(n, gamma, monkeypatch):
    """A line of n ranks on a 1-D torus of n nodes: at step s every message travels |rho(s)| hops the
    shorter way, even ranks one way and odd ranks the other, so ceil(|rho(s)|/2) flows share its busiest
    link (De Sensi et al., NSDI'24, section 3: the congestion Swing keeps low). The bandwidth-optimal form at
    every size (its latency-optimal one would take the smaller buffers at this link's 8 Gbit/s)."""
    monkeypatch.setenv("TORUS_SWING_LATENCY_BYTES", "-1")
    M = 4 * 1024 * n  # divisible by every halving
    alpha, beta = 2e-6, 1e-9
    cost = Cost(alpha=alpha, beta=beta, gamma=gamma, shared_links=True)
    layout = Layout(1, n, 1, network=Network("torus", (n,)))
    got = simulate("swing", "allreduce", layout, M // 4, "float32", cost)
    want = 0.0
    for s in range(int(math.log2(n))):
        m, c = M / 2 ** (s + 1), math.ceil(abs(rho(s)) / 2)
        want += 2 * alpha + (2 * c * beta + gamma) * m
    assert got.time == pytest.approx(want, rel=1e-12)
    star = simulate("swing", "allreduce", Layout(1, n, 1), M // 4, "float32", cost)
    assert star.time == pytest.approx(closed_form.time("swing", "allreduce", M, alpha, beta, gamma, n, 1, n),
                                      rel=1e-12)
    assert got.time > star.time  # the distances cost something from n = 8 on (|rho(2)| = 3)


@pytest.mark.parametrize("X,Y,over", [(4, 4, 2.0), (4, 3, 3.0), (3, 5, 1.5)])
def test_torus2d_on_a_fat_tree_of_one_row_per_leaf(X, Y, over):
    """Rows on leaf switches: the row rings stay inside the leaves, every column message leaves its leaf with
    the X others of that leaf, on an uplink of X / over node links: the column runs at over x beta."""
    M = 4 * X * Y * 64
    a, b, g = 3e-6, 2e-9, 1e-11
    cost = Cost(alpha=a, beta=b, gamma=g, shared_links=True)
    layout = Layout(X, Y, 1, network=Network("fattree", (), X, over))
    got = simulate("torus2d", "allreduce", layout, M // 4, "float32", cost)
    want = closed_form.time("torus2d", "allreduce", M, a, b, g, X * Y, X, Y, X, a, over * b)
    assert got.time == pytest.approx(want, rel=1e-12)
    full_bisection = dataclasses.replace(layout, network=Network("fattree", (), X, 1.0))
    assert simulate("torus2d", "allreduce", full_bisection, M // 4, "float32", cost).time == \
        pytest.approx(closed_form.time("torus2d", "allreduce", M, a, b, g, X * Y, X, Y), rel=1e-12)


@pytest.mark.parametrize("algorithm", ["ring", "torus2d"])
def test_orbit_and_full_replay_price_a_torus_network_alike(algorithm):
    """The lockstep (orbit) pass and the per-rank replay share links by the same rules."""
    cost = Cost(alpha=1e-6, beta=1e-9, gamma=1e-11, shared_links=True, segment_bytes=1 << 14)
    for layout in (Layout(4, 8, 2, network=Network("torus", (2, 8))),
                   Layout(8, 4, 1, network=Network("fattree", (), 4, 3.0))):
        full = simulate(algorithm, "allreduce", layout, 100_003, "float32", cost, "full", shm_phases=False)
        orbit = simulate(algorithm, "allreduce", layout, 100_003, "float32", cost, "orbit", shm_phases=False)
        assert orbit.time == pytest.approx(full.time, rel=1e-9)


def test_a_network_that_does_not_hold_the_nodes_is_refused():
    with pytest.raises(ValueError, match="torus network of 3x3"):
        Layout(4, 4, 1, network=Network("torus", (3, 3)))
    with pytest.raises(ValueError, match="expected star"):
        Network.parse("mesh")
    assert Network.parse("torus", 12, (4, 3)).dims == (4, 3)
    assert Network.parse("torus:2x6", 12).dims == (2, 6)
    assert Network.parse("fattree:4:3").name == "fattree:4:3"
