"""torus-sim: the α-β-γ cost model that replays torus' own schedules (the very plan functions ``TorusComm``
runs) at any scale.

Method. ``plans.plan`` builds a rank's plan with ``torus.schedules.build`` exactly as ``TorusComm`` does; the
named communicators map to world ranks as in ``TorusComm`` (torus.topology: rank = y*X + x; row peers are x,
column peers y; local and cross as nodes of ``ranks_per_node`` consecutive ranks, or of uneven sizes,
``Layout.uneven``). ``replay.full`` compiles every rank's plan as the executor does
(torus.runtime.compile: segments, send deadlines) and replays it with per-rank clocks (model and matching
rules in replay.py and model.py): exact, but Python-speed, so it is used up to 64 ranks. Beyond that
(``method="orbit"``) the symmetry of the schedules is exploited:

- ring (any collective): rank ``r`` does what rank 0 does with peers and chunk indices shifted by ``r``;
- 2D-torus (any collective) and the hierarchical reduce-scatter/all-gather (the torus plans on the
  local x cross grid): rank ``(x, y)`` does what ``(x, 0)`` does, shifted by ``y`` along the column;
- hierarchical all-reduce: every node runs the same node-local phases, so one node is replayed in full and
  the leaders' cross-node ring runs as a ring orbit.

Chunk indices are read off representative plans built with a labelled count (one element per chunk), and the
real sizes come from the real partition, so uneven counts stay exact. Every rank's clock is then advanced
per step with numpy (``replay.lockstep``), the same recurrence as the full replay for step-aligned plans, with
the send deadlines compile_plan gives the representatives. Each orbit run checks its derived messages and
deadlines against the real compiled plans of sampled ranks; tests/test_sim_replay_matches_executor.py checks
that the replay sees what the executor's step interpreter does on the same plans; tests/test_sim.py checks
that orbit and full replay agree on every number at 24 and 64 ranks and that both match the closed forms
(closed_form.py) in the symmetric cases.

A training step with the gradient all-reduce behind backprop (``torus-sim --step``): step.py runs the
communication thread's FIFO schedule over a step profile (profile.py) with each bucket priced by ``simulate``.
"""
from torus.sim.model import Cost, Layout, SimulationError
from torus.sim.simulate import Result, simulate

__all__ = ["Cost", "Layout", "Result", "SimulationError", "simulate"]
