#!/usr/bin/env python
"""The Keras gradient all-reduce alone: ResNet-50's gradient list through ``allreduce_tensors`` inside a
``tf.function``, as ``TorusStrategy`` runs it every step, without the model's compute.

    mpiexec -n 2 python bench/keras_window/keras_allreduce.py --steps 30 \
        --json bench/keras_window/results/keras_allreduce_p2.json

Gradients: one random float32 tensor per trainable variable of ``keras.applications.ResNet50(weights=None,
input_shape=(32, 32, 3), classes=10)`` (214 tensors, 89.9 MiB), the same list every step. Per step a barrier
first (so the time excludes waiting for a slower rank, which a training step adds), then one call of the traced
function (fuse, ``tf.numpy_function`` into ``TorusComm.allreduce``, split back); the figure is the median over
``--steps`` timed steps of the slowest rank's time, after ``--warmup`` untimed ones (tracing, window set-up).
``host_ms`` is the part spent inside ``HostAllreduce`` (the numpy side). Paths, alternating per round of
``--steps`` (``--paths``): ``window`` (the default: on shm, the gradients fused straight into a
``TorusComm.alloc`` buffer and reduced in place) and ``copy`` (``HostAllreduce(window=False)``: fused by
TensorFlow, all-reduced out of place). ``--algorithm`` as ``TorusStrategy``'s. Rank 0 prints one JSON line per
path and round (with the load average) and appends them to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per path and round (30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps per path (3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the paths alternating (3)")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--paths", default="window,copy", help="comma-separated: window, copy")
    ap.add_argument("--json", help="append the result lines to this file")
    args = ap.parse_args()

    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from torus import TorusComm
    from torus.integrations.keras import HostAllreduce, allreduce_tensors

    tc = TorusComm()
    shapes = [tuple(v.shape) for v in keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10).trainable_variables]
    rng = np.random.default_rng(tc.rank)
    grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    hosts, steps = {}, {}
    for path in args.paths.split(","):
        host = hosts[path] = HostAllreduce(tc, args.algorithm, window=path == "window")
        steps[path] = tf.function(lambda g, host=host: allreduce_tensors(host, g, "sum"))
    for step in steps.values():
        for _ in range(args.warmup):
            step(grads)
    nbytes = sum(int(np.prod(s)) for s in shapes) * 4
    for rnd in range(args.rounds):
        for path in (list(steps) if rnd % 2 == 0 else list(steps)[::-1]):
            host, step, times, inside = hosts[path], steps[path], [], []
            load = os.getloadavg()[0]
            for _ in range(args.steps):
                tc.comm.Barrier()
                s0, t0 = host.seconds, time.perf_counter()
                step(grads)
                t = time.perf_counter() - t0
                times.append(tc.comm.allreduce(t, op=max))
                inside.append(tc.comm.allreduce(host.seconds - s0, op=max))
            row = {"ranks": tc.size, "algorithm": args.algorithm, "auto_pick": tc.auto_choice(
                "allreduce", nbytes, True), "path": path, "round": rnd, "tensors": len(shapes),
                "gradient_mib": nbytes / 2**20, "step_ms": 1e3 * float(np.median(times)),
                "step_ms_q1_q3": [1e3 * float(q) for q in np.percentile(times, [25, 75])],
                "host_ms": 1e3 * float(np.median(inside)), "steps": args.steps,
                "load_avg_1min": [load, os.getloadavg()[0]], "cpus": os.cpu_count()}
            if tc.rank == 0:
                line = json.dumps(row)
                print(line, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
