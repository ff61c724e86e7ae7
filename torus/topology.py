"""Where every rank sits: the ``X x Y`` grid and the nodes. Pure (no MPI): TorusComm builds its
sub-communicators from it, and the schedules' rank arguments come from it.

Grid: rank ``r`` is at column ``x = r % X`` of row ``y = r // X`` (row-major Cartesian coordinates, periodic in
both directions; Mikami et al. 2018, arXiv:1811.05233). Nodes: ``node_of[r]`` is rank ``r``'s node index,
nodes numbered in the order of their lowest rank; a node's ranks keep their order (local rank = position
among the node's ranks). Nodes may differ in size.

Sub-communicators of a rank (ranks ordered by their world rank in each): ``"row"`` (same ``y``), ``"col"``
(same ``x``), ``"local"`` (same node), ``"cross"`` (same local rank: one rank per node), ``"world"``.

Ring order: the world-wide ring visits the ranks node by node (``ring_order``), so that it crosses each
node's link once each way whatever the placement; on nodes of consecutive ranks that is the rank order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property


def default_dims(size: int) -> tuple:
    """``(X, Y)`` with ``X <= Y`` and ``X * Y == size``, as square as possible (what ``MPI.Compute_dims``
    gives, rows the shorter side)."""
    X = max(d for d in range(1, int(size ** 0.5) + 1) if size % d == 0)
    return X, size // X


def node_dims(node_of) -> tuple | None:
    """The grid that keeps one axis inside the nodes, or None when there is no such obvious grid.

    ``node_of``: every rank's node index (see :class:`Topology`). Nodes of ``L`` consecutive ranks (hydra's
    ``-hosts h1:L,h2:L``, a hostfile with ``slots``): ``(L, C)``, rows are the nodes. ``C`` nodes dealt out
    round robin (rank ``r`` on node ``r % C``: hydra's ``-hosts h1,h2`` with more ranks than hosts):
    ``(C, L)``, columns are the nodes. Either way the 2D torus moves ``2(C-1)/C * M`` through each node's
    link, as the hierarchical all-reduce does; a square grid whose rows cross nodes moves up to ``L`` times
    that. None for one node, one rank per node, unequal nodes or any other placement."""
    size, nodes = len(node_of), max(node_of, default=0) + 1
    L = size // nodes
    if nodes == 1 or L == 1 or L * nodes != size:
        return None
    if all(n == r // L for r, n in enumerate(node_of)):
        return L, nodes
    if all(n == r % nodes for r, n in enumerate(node_of)):
        return nodes, L
    return None


def node_indices(keys) -> tuple:
    """Any per-rank node key (a host name, the node's lowest rank) -> node index by order of first use."""
    index: dict = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


@dataclass(frozen=True)
class Topology:
    """One rank's view of the grid and the nodes.

    rank, size: this rank and the number of ranks; dims: ``(X, Y)`` with ``X * Y == size``; node_of: the node
    index of every rank (``size`` entries, see the module docstring). Raises ValueError when they disagree.
    """
    rank: int
    size: int
    dims: tuple
    node_of: tuple

    def __post_init__(self):
        X, Y = self.dims
        if X < 1 or Y < 1 or X * Y != self.size:
            raise ValueError(f"dims {X}x{Y} do not multiply to the communicator size {self.size}")
        if len(self.node_of) != self.size or not 0 <= self.rank < self.size:
            raise ValueError(f"node_of has {len(self.node_of)} entries for {self.size} ranks")

    @classmethod
    def emulated(cls, rank: int, size: int, dims, ranks_per_node: int) -> Topology:
        """Nodes of ``ranks_per_node`` consecutive ranks (the last one smaller when it does not divide)."""
        return cls(rank, size, tuple(dims), tuple(r // ranks_per_node for r in range(size)))

    def coords_of(self, r: int) -> tuple:
        """``(x, y)`` of rank ``r``."""
        return r % self.dims[0], r // self.dims[0]

    @property
    def coords(self) -> tuple:
        return self.coords_of(self.rank)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @cached_property
    def nodes(self) -> int:
        return max(self.node_of) + 1

    def members(self, name: str, r: int | None = None) -> tuple:
        """The world ranks of rank ``r``'s (default: this rank's) communicator ``name``, in order."""
        r = self.rank if r is None else r
        x, y = self.coords_of(r)
        same = {"world": lambda q: True,
                "row": lambda q: self.coords_of(q)[1] == y,
                "col": lambda q: self.coords_of(q)[0] == x,
                "local": lambda q: self.node_of[q] == self.node_of[r],
                "cross": lambda q: self.local_rank_of(q) == self.local_rank_of(r)}[name]
        return tuple(q for q in range(self.size) if same(q))

    @cached_property
    def _local_ranks(self) -> tuple:
        seen: Counter = Counter()
        out = []
        for n in self.node_of:
            out.append(seen[n])
            seen[n] += 1
        return tuple(out)

    @cached_property
    def _node_sizes(self) -> Counter:
        return Counter(self.node_of)

    def local_rank_of(self, r: int) -> int:
        return self._local_ranks[r]

    @property
    def local_rank(self) -> int:
        return self.local_rank_of(self.rank)

    @cached_property
    def local_size(self) -> int:
        return self._node_sizes[self.node]

    @cached_property
    def max_local(self) -> int:
        """Ranks on the largest node."""
        return max(self._node_sizes.values())

    def world_rank(self, name: str, peer: int, r: int | None = None) -> int:
        """The world rank of ``peer`` (a rank within rank ``r``'s communicator ``name``)."""
        return self.members(name, r)[peer]

    def split(self, name: str, r: int | None = None) -> tuple:
        """``(color, key)`` for ``MPI.Comm.Split`` giving rank ``r`` its communicator ``name``."""
        r = self.rank if r is None else r
        x, y = self.coords_of(r)
        return {"row": (y, r), "col": (x, r), "local": (self.node_of[r], r),
                "cross": (self.local_rank_of(r), r)}[name]

    def _inside_nodes(self, name: str) -> bool:
        """True when every ``name`` ("row" or "col") communicator lies within one node."""
        X, Y = self.dims
        lines = ([range(y * X, (y + 1) * X) for y in range(Y)] if name == "row"
                 else [range(x, self.size, X) for x in range(X)])
        return all(len({self.node_of[r] for r in line}) == 1 for line in lines)

    @cached_property
    def node_axis(self) -> str | None:
        """The grid axis whose communicators lie within nodes ("row" preferred, "col"), or None: where the
        2D torus' first phase stays inside the nodes. None on one node."""
        if self.nodes == 1:
            return None
        return "row" if self._inside_nodes("row") else "col" if self._inside_nodes("col") else None

    @cached_property
    def columns_first(self) -> bool:
        """True when the 2D-torus all-reduce should run along the columns first: the columns lie within
        nodes and the rows do not (nodes dealt out round robin). Its first and last phases then stay
        inside the nodes and only ``1/Y`` of the buffer crosses them, as in the rows-first order when the
        rows are the nodes."""
        return self.node_axis == "col"

    @cached_property
    def ring_order(self) -> tuple:
        """The world ranks in the order of the world-wide ring: node-major (nodes by index, each node's ranks
        in rank order). Nodes of consecutive ranks (placed in blocks, or emulated): ``0 .. size-1``. Dealt out
        round robin (hydra's ``-hosts h1,h2`` with more ranks than hosts), the rank order would cross a node
        link at every hop; this order crosses ``nodes`` hops of ``size``, one into and one out of each node.
        The same on every rank (``node_of`` is)."""
        return tuple(sorted(range(self.size), key=lambda r: (self.node_of[r], r)))

    @cached_property
    def ring_position(self) -> int:
        """This rank's index in ``ring_order``."""
        return self.ring_order.index(self.rank)

    @cached_property
    def node_grid(self) -> bool:
        """True when every node holds the same number of consecutive ranks: what the hierarchical
        reduce-scatter and all-gather need (their blocks follow the rank order); else they fall back to the
        ring."""
        L = self.local_size
        return self.nodes * L == self.size and all(n == r // L for r, n in enumerate(self.node_of))

    def hierarchical_args(self) -> tuple[int, int, int, int]:
        """``(local_rank, local_size, node, nodes)``: the hierarchical schedules' position arguments."""
        return self.local_rank, self.local_size, self.node, self.nodes
