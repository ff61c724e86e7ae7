#!/usr/bin/env python
"""Weak scaling of TorusStrategy: ResNet-50 step time at a fixed per-rank batch, and the share of the step
spent inside the fused gradient all-reduce (the ``tf.numpy_function``; it includes waiting for the slowest
rank).

Run once per rank count and compare (efficiency = t(1 rank) / t(N ranks)):

    mpiexec -n 1 python bench/keras_window/keras_scaling.py --json bench/keras_window/results/keras_scaling.json
    mpiexec -n 2 python bench/keras_window/keras_scaling.py --json bench/keras_window/results/keras_scaling.json

Model: ``keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)`` (23.6 M parameters,
90 MiB of float32 gradients), SGD with momentum, random data, one TensorFlow thread per rank
(intra/inter-op = 1). The first ``--warmup`` steps (tracing) are not timed; the step time is the median over
``--steps`` steps of rank 0's wall time between batch begin and batch end (every step ends with the all-reduce,
so ranks stay in lock-step). ``allreduce_s`` is the time inside ``HostAllreduce``: with ``--window on`` (where
shm runs) that includes fusing and splitting, which ``--window off`` leaves to TensorFlow outside it;
bench/keras_window/keras_allreduce.py times the whole path alike. Rank 0 prints one JSON line and, with
``--json``, appends it to that file.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (32)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps (8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (2)")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--compression", default="none", choices=("none", "fp16", "bf16"))
    ap.add_argument("--window", choices=("on", "off"), default="on",
                    help="fuse the gradients into a TorusComm.alloc buffer where shm runs (HostAllreduce.window)")
    ap.add_argument("--json", help="append the result line to this file")
    args = ap.parse_args()

    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy(algorithm=args.algorithm, compression=args.compression)
    strategy.host.window = args.window == "on"  # read when the step is traced
    with strategy.scope():
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy",
                      jit_compile=False)
    # fit's batch_size is the global batch: every rank holds the same arrays and trains on its 1/N of each batch
    global_batch = args.batch * strategy.size
    rng = np.random.default_rng(0)
    n = global_batch * (args.warmup + args.steps)
    x = rng.random((n, 32, 32, 3), np.float32)
    y = rng.integers(0, 10, n)
    host = strategy.host
    times, reduce_s = [], []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0, self.r0 = time.perf_counter(), host.seconds

        def on_train_batch_end(self, batch, logs=None):
            if batch >= args.warmup:
                times.append(time.perf_counter() - self.t0)
                reduce_s.append(host.seconds - self.r0)

    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=strategy.callbacks() + [Timer()])
    step, red = float(np.median(times)), float(np.median(reduce_s))
    grads = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    result = {"ranks": strategy.size, "per_rank_batch": args.batch, "algorithm": args.algorithm,
              "window": args.window, "windows_made": strategy.host.windows.made,
              "compression": args.compression, "grid": list(strategy.torus_comm.dims), "gradient_mib":
              grads * 4 / 2**20, "step_s": step, "allreduce_s": red, "allreduce_fraction": red / step,
              "images_per_s": args.batch * strategy.size / step, "steps_timed": len(times),
              "tf_threads": 1, "cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}
    if strategy.is_chief:
        line = json.dumps(result)
        print(line)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
