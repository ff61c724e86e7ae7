"""The α-β-γ cost of one message and the map from named communicators to world ranks.

Hockney's model (Hockney 1994, "The communication challenge for MPP", Parallel Computing 20(3)) with the
reduction term of Thakur, Rabenseifner & Gropp 2005 ("Optimization of collective communication operations in
MPICH", IJHPCA 19(1), section 2): a message of ``b`` bytes costs ``α + β·b`` seconds and reducing it costs
``γ·b``. Two levels: a message whose peer sits on another node (world rank // ranks_per_node differs) pays
``inter_alpha``/``inter_beta`` instead.

Segmentation (``segment_bytes``, the executor's pipelining unit): the replay runs the segments the executor
sends (torus.runtime.compile), each paying ``α + β·b`` and its own reduction, one segment after another, so a
message of ``k`` segments pays ``k·α + β·b`` and only the reduction of the last segment is exposed, plus
whatever part of the earlier segments' reductions is longer than the next segment's transfer (replay.py).
Without ``segment_bytes`` a message is one segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from torus.errors import TorusError
from torus.sim.network import Network
from torus.topology import Topology

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


class SimulationError(TorusError):
    """A plan the executor could not run: unmatched or mis-sized messages, or a deadlock."""


@dataclass(frozen=True)
class Cost:
    """Seconds per message (alpha), per byte moved (beta), per byte reduced (gamma); inter_* for messages
    between nodes (default: the same as intra-node); segment_bytes: pipelining unit, None for none;
    shared_links: ranks of one node sending (or receiving) across nodes at the same step share the node's
    link, each at its share of ``1 / inter_beta`` (replay.py); off, every message gets the whole link (the
    closed forms' assumption). The shared-memory transport (sim/shm.py) is priced by ``copy_beta`` (seconds
    per byte of a memory copy; default ``beta``), ``flag_alpha`` (seconds until a flag one rank stores is seen
    by the others; default ``alpha``) and ``call_alpha`` (seconds per call around its step loop; default 0),
    with ``gamma``; ``segment_bytes`` is then its slot (None: the transport's default); its in-place all-reduce
    of a ``TorusComm.alloc`` buffer also by ``window_beta`` (seconds per byte copied between two buffers, neither
    in cache: a peer's reduced chunk from its buffer into ours; default ``copy_beta``). Across nodes the
    node-level shared-memory phases of a phased call (sim/phased.py) run at the slot ``shm_slot_bytes``
    (None: the transport's default, torus.runtime.shm.SEGMENT_BYTES), rounded up as the transport rounds it."""
    alpha: float = 1e-6
    beta: float = 1e-10
    gamma: float = 0.0
    inter_alpha: float | None = None
    inter_beta: float | None = None
    segment_bytes: int | None = None
    shared_links: bool = False
    copy_beta: float | None = None
    flag_alpha: float | None = None
    call_alpha: float = 0.0
    window_beta: float | None = None
    shm_slot_bytes: int | None = None

    def link_gbits(self) -> float | None:
        """Gbit/s of the link between nodes (``1 / inter_beta``), what ``TorusComm.link_gbits`` measures; None
        for a link priced at no time per byte."""
        beta = self.beta if self.inter_beta is None else self.inter_beta
        return 8 / (beta * 1e9) if beta > 0 else None

    def link(self, crossing):
        """(α, β) for a message, or arrays of them for a boolean array ``crossing``."""
        ia = self.alpha if self.inter_alpha is None else self.inter_alpha
        ib = self.beta if self.inter_beta is None else self.inter_beta
        if isinstance(crossing, np.ndarray):
            return np.where(crossing, ia, self.alpha), np.where(crossing, ib, self.beta)
        return (ia, ib) if crossing else (self.alpha, self.beta)


@dataclass(frozen=True)
class Layout:
    """``N = X * Y`` ranks; rank ``r`` at column ``x = r % X`` of row ``y = r // X`` (as ``TorusComm``);
    nodes of ``ranks_per_node`` consecutive ranks, which are also the hierarchical schedule's local groups, or
    (``node_sizes``, see ``uneven``) runs of consecutive ranks of those sizes, or (``node_of``, see ``placed``
    and ``round_robin``) any placement, ``ranks_per_node`` then the largest node; ``network``: how the nodes
    are wired (sim/network.py; priced with ``Cost.shared_links``). Raises ValueError when the nodes do not
    cover the grid or the network does not hold them."""
    X: int
    Y: int
    ranks_per_node: int = 1
    node_sizes: tuple | None = None
    node_of: tuple | None = None
    network: Network = Network()

    def __post_init__(self):
        if self.node_of is not None:
            used = sorted(set(self.node_of))
            if len(self.node_of) != self.N or used != list(range(len(used))) or \
                    self.ranks_per_node != max(self.node_of.count(n) for n in used):
                raise ValueError(f"torus-sim: a placement of {len(self.node_of)} ranks on nodes {used} does not "
                                 f"cover the grid {self.X}x{self.Y} (nodes numbered 0.. in use)")
        elif self.node_sizes is not None:
            if sum(self.node_sizes) != self.N or min(self.node_sizes) < 1 or \
                    self.ranks_per_node != max(self.node_sizes):
                raise ValueError(f"torus-sim: nodes of {list(self.node_sizes)} ranks do not cover the grid "
                                 f"{self.X}x{self.Y}")
        elif self.X < 1 or self.Y < 1 or self.ranks_per_node < 1 or self.N % self.ranks_per_node:
            raise ValueError(f"torus-sim: grid {self.X}x{self.Y} with {self.ranks_per_node} ranks per node "
                             "is not a whole number of equal nodes")
        self.network.check(self.nodes)

    @classmethod
    def uneven(cls, X: int, Y: int, node_sizes) -> Layout:
        """Nodes of ``node_sizes`` consecutive ranks (in rank order)."""
        sizes = tuple(int(n) for n in node_sizes)
        return cls(X, Y, max(sizes, default=0), sizes)

    @classmethod
    def placed(cls, X: int, Y: int, node_of, network: Network = Network()) -> Layout:
        """Rank ``r`` on node ``node_of[r]`` (nodes numbered in the order of their lowest rank, as
        torus.topology); nodes of consecutive ranks become the equivalent ``Layout`` or ``uneven``."""
        node_of = tuple(int(n) for n in node_of)
        sizes = [node_of.count(n) for n in range(max(node_of, default=-1) + 1)]
        if list(node_of) == [n for n, k in enumerate(sizes) for _ in range(k)] and sizes and min(sizes) > 0:
            if len(set(sizes)) == 1:
                return cls(X, Y, sizes[0], network=network)
            return cls(X, Y, max(sizes), tuple(sizes), network=network)
        return cls(X, Y, max(sizes, default=0), None, node_of, network)

    @classmethod
    def round_robin(cls, X: int, Y: int, nodes: int) -> Layout:
        """Rank ``r`` on node ``r % nodes`` (hydra's ``-hosts h1,h2`` with more ranks than hosts)."""
        return cls.placed(X, Y, [r % nodes for r in range(X * Y)])

    @property
    def block(self) -> bool:
        """Nodes of equal runs of consecutive ranks (what the orbit fast paths assume)."""
        return self.node_sizes is None and self.node_of is None

    @property
    def N(self) -> int:
        return self.X * self.Y

    @cached_property
    def _node_of(self) -> np.ndarray:
        if self.node_of is not None:
            return np.asarray(self.node_of, np.int64)
        sizes = self.node_sizes or (self.ranks_per_node,) * (self.N // self.ranks_per_node)
        return np.repeat(np.arange(len(sizes)), sizes)

    @property
    def nodes(self) -> int:
        if self.node_of is not None:
            return max(self.node_of) + 1
        return len(self.node_sizes) if self.node_sizes is not None else self.N // self.ranks_per_node

    @cached_property
    def _topologies(self) -> dict:
        return {}

    @cached_property
    def _members(self) -> dict:
        return {}  # (rank, communicator) -> its world ranks, for placements without a closed form

    def topology(self, rank: int) -> Topology:
        """Rank ``rank``'s view of this layout, as TorusComm builds it (torus.topology)."""
        topo = self._topologies.get(rank)
        if topo is None:
            topo = self._topologies[rank] = Topology(rank, self.N, (self.X, self.Y),
                                                     tuple(int(n) for n in self._node_of))
        return topo

    def world(self, rank: int, comm: str, peer: int) -> int:
        """World rank of ``peer`` in ``rank``'s communicator ``comm`` (names as in plan.py): for equal nodes
        the closed form of ``topology(rank).world_rank(comm, peer)``, O(1) at any scale; other nodes ask the
        topology."""
        X, L = self.X, self.ranks_per_node
        if comm == "world":
            return peer
        if comm == "row":
            return rank - rank % X + peer
        if comm == "col":
            return peer * X + rank % X
        if comm not in ("local", "cross"):
            raise SimulationError(f"torus-sim on rank {rank}: unknown communicator {comm!r}")
        if not self.block:
            members = self._members.get((rank, comm))
            if members is None:
                members = self._members[(rank, comm)] = self.topology(rank).members(comm)
            return members[peer]
        if comm == "local":
            return rank - rank % L + peer
        return peer * L + rank % L

    def node(self, rank):
        """The node index of ``rank`` (an int or an integer array)."""
        if self.block:
            return rank // self.ranks_per_node
        return self._node_of[rank]
