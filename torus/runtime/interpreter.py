"""The step interpreter: runs a compiled plan (torus.runtime.compile) over MPI point-to-point, once for every
kind of memory, against a memory policy (torus.runtime.memory: ``HostMemory``, ``DeviceMemory``).

Per step: wait for the sends whose deadline it is, bring in the out-of-place input the step needs
(``prefill``), post every receive (into the buffer, or into scratch for a reducing receive), let the policy
stage what the sends read, post every send, wait for those the step's reductions overwrite
(``inner``), then wait for the receives in order and hand each to the policy
as it arrives (the host reduces it at once, so later segments' transfer overlaps this segment's reduction;
the device batches them per step). At the end: wait for the remaining sends, let the policy finish.

Waiting polls with ``MPI.Request.Test`` when a timeout is set (torus.faults.wait), so a dead or stuck peer
turns into ``torus.errors.TimeoutError`` naming the operation, step and peer instead of a silent hang.

For host memory the C step loop (torus.runtime.c_step_loop, ``src/_step_loop.pyx``) runs this same loop
where it is built; this one is the fallback (``TORUS_C_LOOP=0``) and the reference the C one is tested
against (tests/mpi/test_python_loop.py).
"""
from __future__ import annotations

from mpi4py import MPI

from torus.runtime.compile import TAG_MOD, CompiledPlan


def run(ex, what: str, plan: CompiledPlan, memory) -> None:
    """Execute ``plan`` with the buffers of ``memory``; ``ex`` (runtime.executor.Executor) waits and names
    stalls."""
    nsteps = len(plan.steps)
    reqs: list = [None] * len(plan.sends)  # send requests by sid, waited for at their deadline step
    for si, step in enumerate(plan.steps):
        if step.retire:
            ex.wait_sends(reqs, step.retire, plan, what)
        memory.prefill(step.prefill)
        if step.scale is not None:
            memory.scale(*step.scale)
            continue
        tag = si % TAG_MOD
        pending = [m.comm.Irecv([memory.recv_target(m), MPI.BYTE], m.peer, tag) for m in step.recvs]
        memory.stage_sends(step.sends)
        for m in step.sends:
            reqs[m.sid] = m.comm.Isend([memory.send_data(m), MPI.BYTE], m.peer, tag)
        if step.inner:
            ex.wait_sends(reqs, step.inner, plan, what)
        for req, m in zip(pending, step.recvs):
            ex.wait(req, what, si, nsteps, m)
            memory.received(m)
        memory.step_done(step)
    ex.wait_sends(reqs, plan.tail, plan, what)
    memory.finish()
