#!/usr/bin/env python
"""One training step of an ordinary ``model.fit`` script under ``TorusStrategy`` with default settings, timed on
rank 0: the figure to compare two source trees side by side (bench/harness/ab.py; bench/overlap/README.md
has the command).

    mpiexec -n 2 python bench/overlap/one_host_step.py --model resnet50 --steps 20

Uses only the public API that every version of torus has (``TorusStrategy()``, ``scope``, ``fit``), so an older
checkout runs it unchanged. Prints one JSON line: the median and the quartiles of rank 0's step (batch begin to
batch end, seconds) after ``--warmup`` untimed steps, the tree it imported torus from, the 1-minute load average.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("resnet50", "mlp"), default="resnet50")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (32)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    import keras
    import numpy as np

    import torus
    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        if args.model == "resnet50":
            model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
            shape: tuple[int, ...] = (32, 32, 3)
        else:
            model = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(1024, activation="relu")
                                                              for _ in range(4)] + [keras.layers.Dense(10)])
            shape = (256,)
        model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rows = args.batch * strategy.size * (args.steps + args.warmup)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, *shape)).astype("float32")
    y = rng.integers(0, 10, rows).astype("int32")

    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t0)

    model.fit(x, y, batch_size=args.batch * strategy.size, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    if strategy.is_chief:
        q1, med, q3 = np.percentile(times[args.warmup:], [25, 50, 75])
        print(json.dumps({"tree": os.path.dirname(os.path.dirname(torus.__file__)), "model": args.model,
                          "ranks": strategy.size, "step_s": round(float(med), 4), "q1": round(float(q1), 4),
                          "q3": round(float(q3), 4), "load_avg_1min": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
