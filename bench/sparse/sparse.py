#!/usr/bin/env python
"""Sparse gradients gathered as IndexedSlices against made dense (``TorusStrategy(sparse_as_dense=...)``): a
``fit`` step of an embedding model, the two modes alternating in one run.

    mpiexec -n 2 python bench/sparse/sparse.py --vocab 100000 --dim 64
    python -m tests.cluster run -- -n 2 python bench/sparse/sparse.py --vocab 100000 --dim 64

Model: ``Embedding(vocab, dim)`` on ``--length`` ids per row, global average pooling, ``Dense(10)``; Adam;
``--batch`` rows per rank. Per round and mode the train function is traced again (``make_train_function``);
the figure is the median over ``--steps`` steps (after 2 warm-up) of rank 0's wall time, median over rounds.
Rank 0 prints one JSON line (and appends it to ``--json``): per mode the step seconds, and the bytes each
rank sends per step for the embedding (rows x dim x 4 + indices x 8 gathered, or the vocab x dim x 4 all-reduce).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="rows per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    import keras
    import numpy as np

    from torus.integrations.keras import TorusStrategy

    strategy = TorusStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((args.length,), dtype="int32"),
                                  keras.layers.Embedding(args.vocab, args.dim),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    rng = np.random.default_rng(0)
    global_batch = args.batch * strategy.size
    n = global_batch * (args.steps + 2)
    x = rng.integers(0, args.vocab, (n, args.length)).astype(np.int32)
    y = rng.integers(0, 10, n)

    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= 2:
                times.append(time.perf_counter() - self.t0)

    rounds: dict[str, list[float]] = {"sparse": [], "dense": []}
    for _ in range(args.rounds):
        for mode in rounds:
            strategy.host.sparse_as_dense = mode == "dense"
            model.make_train_function(force=True)
            times.clear()
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
            rounds[mode].append(float(np.median(times)))
    rows = args.batch * args.length
    result = {"vocab": args.vocab, "dim": args.dim, "rows_per_rank": rows, "ranks": strategy.size,
              "nodes": strategy.torus_comm.topology.nodes, "link_gbits": strategy.torus_comm.link_gbits,
              "sparse_step_s": float(np.median(rounds["sparse"])), "dense_step_s": float(np.median(rounds["dense"])),
              "sparse_bytes": rows * (args.dim * 4 + 8), "dense_bytes": args.vocab * args.dim * 4,
              "per_round": rounds, "load_avg_1min": os.getloadavg()[0]}
    result["sparse_over_dense"] = result["sparse_step_s"] / result["dense_step_s"]
    if strategy.is_chief:
        line = json.dumps(result)
        print(line)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
