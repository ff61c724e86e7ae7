"""Snapshots of the training state for recovery (issue 42), framework-neutral: named numpy arrays and a JSON
dict per global step, one file each, written in the background on one rank per node and agreed on at start.

- :mod:`torus.snapshot.format`: the file (header, arrays, CRC-32), written atomically, verified on reading.
- :mod:`torus.snapshot.store`: a job's snapshots on this node: ``save_async``, keep the newest two, find the
  newest complete one.
- :mod:`torus.snapshot.background`: the writer thread (one write in flight, the latest pending one wins).
- :mod:`torus.snapshot.cadence`: when a snapshot is due (``TORUS_SNAPSHOT_STEPS``, ``TORUS_SNAPSHOT_SECONDS``).
- :mod:`torus.snapshot.agree`: every rank gets the newest snapshot any rank holds; who writes (one rank per node).

What goes into a snapshot, and resuming a model from one, is the framework layer's part.
"""
from torus.snapshot.agree import agree_newest, node_writer
from torus.snapshot.cadence import Cadence
from torus.snapshot.format import Snapshot, SnapshotCorrupt
from torus.snapshot.store import SnapshotSkipped, SnapshotStore

__all__ = ["SnapshotStore", "SnapshotCorrupt", "SnapshotSkipped", "Snapshot", "Cadence", "agree_newest",
           "node_writer"]
