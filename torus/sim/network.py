"""How the nodes are wired: the links a message between two nodes crosses, and how flows share them.

Three networks (``Network.kind``):

- ``star`` (the default): every node on one non-blocking switch, as the emulated cluster's bridge or a fat tree
  of full bisection: a message between nodes crosses its sender's node link out and its receiver's node link in.
- ``torus``: the nodes on a ``dims`` torus (node ``n`` at coordinates ``n % p, n // p % q, ...``), each joined
  to its two neighbours along every dimension by a link each way; a message goes one dimension after the
  other, lowest first, the shorter way round (half-way round: the positive way), one link per hop:
  dimension-order routing (Dally & Seitz 1987, "Deadlock-free message routing in multiprocessor
  interconnection networks", IEEE Trans. Computers C-36(5)). A node drives its ``2 * len(dims)`` ports at once,
  so its own node link has that many links' worth.
- ``fattree``: two levels: leaf switches of ``leaf`` consecutive nodes, each leaf's up- and downlink to the
  spine ``leaf / oversubscription`` node links' worth (1: full bisection, which prices as ``star``; 3: the
  common 3:1 taper); a message between leaves crosses out, up, down, in.

Sharing (replay.py): the flows that cross a link at the same step share it equally, each at ``capacity / flows``
of the node-link rate (``Cost.inter_beta``); a message runs at the rate of its most shared link, never faster
than its node link. A flow is one rank: a rank's messages of one step queue at its own port already, so the
ranks sending (the receiving ranks, on a node link in) are counted, not their messages. Latency does not grow
with hops (cut-through routing; ``Cost.inter_alpha`` per message).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("star", "torus", "fattree")


@dataclass(frozen=True)
class Network:
    """``kind`` (see the module), ``dims`` (torus: nodes per dimension), ``leaf`` (fattree: nodes per leaf
    switch), ``oversubscription`` (fattree: a leaf's node links per uplink's worth)."""
    kind: str = "star"
    dims: tuple = ()
    leaf: int = 0
    oversubscription: float = 1.0

    def check(self, nodes: int) -> None:
        """Raises ValueError when this network cannot hold ``nodes`` nodes."""
        if self.kind not in KINDS:
            raise ValueError(f"torus-sim: unknown network {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind == "torus" and (not self.dims or min(self.dims) < 1 or int(np.prod(self.dims)) != nodes):
            raise ValueError(f"torus-sim: a torus network of {'x'.join(map(str, self.dims)) or 'no dims'} does not "
                             f"hold {nodes} nodes")
        if self.kind == "fattree" and (self.leaf < 1 or not self.oversubscription > 0):
            raise ValueError(f"torus-sim: a fat tree needs leaf >= 1 nodes per leaf switch and an "
                             f"oversubscription > 0 (got {self.leaf}, {self.oversubscription})")

    @property
    def name(self) -> str:
        if self.kind == "torus":
            return "torus:" + "x".join(map(str, self.dims))
        if self.kind == "fattree":
            return f"fattree:{self.leaf}:{self.oversubscription:g}"
        return "star"

    @classmethod
    def parse(cls, text: str, nodes: int | None = None, node_grid: tuple | None = None) -> Network:
        """``star``, ``torus`` (the nodes on ``node_grid``, else as square as possible), ``torus:PxQ[xR..]``,
        ``fattree:LEAF`` or ``fattree:LEAF:OVERSUB``, checked against ``nodes`` (None: the syntax only).
        Raises ValueError on anything else."""
        kind, _, rest = text.partition(":")
        try:
            if kind == "star" and not rest:
                net = cls()
            elif kind == "torus":
                dims = tuple(int(d) for d in rest.lower().split("x")) if rest else \
                    (node_grid or _square(nodes or 1))
                net = cls("torus", dims)
            elif kind == "fattree" and rest:
                leaf, _, over = rest.partition(":")
                net = cls("fattree", (), int(leaf), float(over) if over else 1.0)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"torus-sim: network {text!r}: expected star, torus[:PxQ], fattree:LEAF[:OVERSUB]") \
                from None
        if net.kind == "torus" and min(net.dims) < 1:
            raise ValueError(f"torus-sim: network {text!r}: a torus needs at least one node per dimension")
        if nodes is not None:
            net.check(nodes)
        elif net.kind == "fattree":
            net.check(net.leaf)
        return net

    def _capacity(self, nodes: int) -> np.ndarray:
        """Per link (ids as ``_links``), its rate in node links."""
        port = 2.0 * len(self.dims) if self.kind == "torus" else 1.0
        cap = [np.full(2 * nodes, port)]
        if self.kind == "torus":
            cap.append(np.ones(nodes * 2 * len(self.dims)))
        elif self.kind == "fattree":
            cap.append(np.full(2 * -(-nodes // self.leaf), self.leaf / self.oversubscription))
        return np.concatenate(cap)

    def _links(self, src, dst, nodes: int):
        """For messages from node ``src[i]`` to ``dst[i]`` (arrays, ``src != dst``): ``(message, link, inward)``
        per link crossed: the message's index, the link id (``[0, nodes)`` node links out, ``[nodes, 2*nodes)``
        node links in, then the network's own) and whether it is the receiver's node link."""
        m = np.arange(src.size)
        msg, link, inward = [m, m], [src, nodes + dst], [np.zeros(src.size, bool), np.ones(src.size, bool)]
        if self.kind == "torus":
            D = len(self.dims)
            stride = np.cumprod((1, *self.dims[:-1]))
            cur = [(src // stride[d]) % n for d, n in enumerate(self.dims)]
            for d, n in enumerate(self.dims):
                delta = ((dst // stride[d]) % n - cur[d]) % n
                positive = 2 * delta <= n
                hops = np.where(positive, delta, n - delta)
                sign = np.where(positive, 1, -1)
                for k in range(int(hops.max(initial=0))):
                    on = hops > k
                    here = sum(c[on] * stride[e] for e, c in enumerate(cur))
                    msg.append(m[on])
                    link.append(2 * nodes + here * 2 * D + 2 * d + (~positive[on]).astype(np.int64))
                    inward.append(np.zeros(int(on.sum()), bool))
                    cur[d] = np.where(on, (cur[d] + sign) % n, cur[d])
        elif self.kind == "fattree":
            leaves = -(-nodes // self.leaf)
            a, b = src // self.leaf, dst // self.leaf
            apart = a != b
            msg += [m[apart], m[apart]]
            link += [2 * nodes + a[apart], 2 * nodes + leaves + b[apart]]
            inward += [np.zeros(int(apart.sum()), bool)] * 2
        return np.concatenate(msg), np.concatenate(link), np.concatenate(inward)

    def slowdown(self, nodes: int, src, dst, sender, receiver, send_step, recv_step) -> np.ndarray:
        """Per message between nodes (arrays: nodes ``src``/``dst``, ranks ``sender``/``receiver``, the steps
        at which they post it): the factor on its ``β`` (>= 1), the flow count over capacity of its most shared
        link. A link's flows are the distinct ranks crossing it at one step: the senders' at their step, on a
        node link in the receivers' at theirs."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if src.size == 0:
            return np.ones(0)
        msg, link, inward = self._links(src, dst, nodes)
        step = np.where(inward, np.asarray(recv_step, np.int64)[msg], np.asarray(send_step, np.int64)[msg])
        flow = np.where(inward, np.asarray(receiver, np.int64)[msg], np.asarray(sender, np.int64)[msg])
        cap = self._capacity(nodes)
        pair = (step - step.min()) * cap.size + link
        ranks = int(flow.max()) + 1
        distinct = np.unique(pair * ranks + flow) // ranks
        keys, counts = np.unique(distinct, return_counts=True)
        load = counts[np.searchsorted(keys, pair)] / cap[link]
        out = np.ones(src.size)
        np.maximum.at(out, msg, load)
        return out


def _square(n: int) -> tuple[int, int]:
    x = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return x, n // x
