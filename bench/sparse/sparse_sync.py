#!/usr/bin/env python
"""What keeping the replicas bitwise equal under sparse updates costs per step: the ways side by side, interleaved
step by step.

    mpiexec -n 2 python bench/sparse/sparse_sync.py --json bench/sparse/results/sparse_sync.json

Model: ``Embedding(--vocab, --dim)`` on ``--length`` ids per row (Zipf-like: id k drawn with weight 1/(k+10), so
a batch repeats its frequent ids), global average pooling, ``Dense(10)``, under ``TorusStrategy``, global batch
``--batch``. TensorFlow's default threading (on 2 cores: 2 intra-op threads per rank, so the CPU scatter splits
across threads, as users run it). Ways (``--ways``), each on its own model and optimizer from the same initial
weights, its train step traced by a first ``fit``:

- ``current``: the gathered IndexedSlices straight into the optimizer (before issue 41; the ranks drift apart);
- ``scatter``: what torus does (``sparse.deterministic_scatters``): the optimizer's sparse assigns reduced to
  unique indices (``tf.unique`` + ``unsorted_segment_sum``) before the scatter; no communication;
- ``dedup``: the gathered slices summed to unique indices before the optimizer sees them (changes Keras'
  row-by-row semantics: no longer one process' result for Adam, RMSprop, Adagrad);
- ``rows``: after the update rank 0 broadcasts the touched rows (unique gathered indices) of the variable and of
  its same-shaped slots, the others scatter them in (unique indices: deterministic); one ``MPI_Ibcast`` each;
- ``whole``: after the update rank 0 broadcasts the whole variable and its same-shaped slots.

Timing: rank 0's state is broadcast to every model, then ``--rounds`` rounds; in each, every way runs one train
step (its traced ``train_function`` on its own iterator over the same batches), the ways in a freshly shuffled
order (the same on every rank), so a burst of load on a shared machine hits every way alike. Per way: the median
step time on rank 0, the median of the per-round ratio to ``current``, the fastest step; then every rank's
weights and optimizer variables are compared as bytes, and rank 0's weights against ``current``'s (every model
started from the same weights and took the same batches: float summation order for ``scatter``, ``rows`` and
``whole``, Keras' semantics changed for ``dedup``). Also timed alone (``--reps`` calls each, median): the
pieces the ways add. Rank 0 prints a table and writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WAYS = ("current", "scatter", "dedup", "rows", "whole")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--length", type=int, default=20, help="ids per row (20)")
    ap.add_argument("--batch", type=int, default=256, help="global batch (256)")
    ap.add_argument("--rounds", type=int, default=200, help="timed steps per way (200)")
    ap.add_argument("--optimizers", default="rmsprop,adagrad,adam")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--reps", type=int, default=200, help="calls per timed piece (200)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    from torus import faults
    from torus.integrations.keras import TorusStrategy
    from torus.integrations.keras.collectives import sparse
    from torus.integrations.keras.collectives.loop import stall_timeout
    from torus.integrations.keras.fit import optimizer as gradients

    strategy = TorusStrategy()
    tc = strategy.torus_comm
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or "current" not in ways:
        raise SystemExit(f"sparse_sync on rank {tc.rank}: --ways {args.ways}: expected 'current' and some of {WAYS}")

    # Which way the model being traced takes: read by the wrappers below while its first fit traces its step.
    tracing = {"way": "scatter", "gathered": []}
    keep_deterministic = gradients.deterministic_scatters
    keep_reduce = gradients.reduce_gradients

    def deterministic_scatters(optimizer):
        if tracing["way"] == "scatter":
            keep_deterministic(optimizer)

    def reduce_gradients(host, grads, op="sum", sparse_as_dense=None):
        out = keep_reduce(host, grads, op, sparse_as_dense)
        if tracing["way"] == "dedup":
            out = [sparse.unique_slices(g) if isinstance(g, tf.IndexedSlices) else g for g in out]
        tracing["gathered"] = out
        return out

    gradients.deterministic_scatters = deterministic_scatters
    gradients.reduce_gradients = reduce_gradients

    def broadcast(tensors):
        """Rank 0's ``tensors`` on every rank: one ``MPI_Ibcast`` per tensor on the communication thread, after
        the collectives the step queued before it."""
        host, comm, timeout = strategy.host, tc.comm, stall_timeout(tc)

        def on_thread(*arrays):
            out = []
            for a in arrays:
                a = np.ascontiguousarray(a)
                faults.wait(comm.Ibcast(a.reshape(-1).view(np.uint8), root=0), timeout,
                            lambda: f"sparse_sync broadcast on rank {tc.rank}: no progress for {timeout} s")
                out.append(a)
            return out

        with tf.control_dependencies(host.after_previous()):
            out = tf.numpy_function(lambda *a: host.progress.call(on_thread, *a), tensors,
                                    [t.dtype for t in tensors], stateful=True, name="sparse_sync_broadcast")
        host.record(out[0])
        return out

    def resynchronise(optimizer, variables, whole: bool):
        """After the update: rank 0's rows (or whole values) of each sparse-updated variable and its slots."""
        reads, targets = [], []
        for g, v in zip(tracing["gathered"], variables):
            if not isinstance(g, tf.IndexedSlices):
                continue
            prefix = v.path.replace("/", "_") + "_"  # Keras names a slot after its variable's path
            group = [v] + [s for s in optimizer.variables if s.name.startswith(prefix) and s.shape == v.shape]
            rows = None if whole else tf.unique(g.indices).y
            for t in group:
                reads.append(tf.identity(t.value) if whole else tf.gather(t.value, rows))
                targets.append((t, rows))
        if not reads:
            return
        got = broadcast(reads)
        if tc.rank == 0:
            return
        for (t, rows), value in zip(targets, got):
            if whole:
                value.set_shape(t.shape)
                t.value.assign(value)
            else:
                value.set_shape([None, *t.shape[1:]])
                t.value.scatter_update(tf.IndexedSlices(value, rows))

    def with_resync(optimizer, whole: bool):
        gradients.reduce_first(optimizer, strategy)
        inner = optimizer.apply

        def apply(grads, trainable_variables=None):
            result = inner(grads, trainable_variables)
            context = tf.distribute.get_replica_context()
            if context is not None and context.strategy is strategy:
                variables = optimizer._trainable_variables if trainable_variables is None else trainable_variables
                resynchronise(optimizer, list(variables), whole)
            return result

        apply._torus_strategy = strategy  # reduce_first leaves it in place
        object.__setattr__(optimizer, "apply", apply)

    rng = np.random.default_rng(0)
    weight = 1.0 / (np.arange(args.vocab) + 10.0)
    x = rng.choice(args.vocab, (8 * args.batch, args.length), p=weight / weight.sum()).astype(np.int32)
    y = rng.integers(0, 10, len(x))
    first = x[:args.batch].reshape(-1)
    make = {"rmsprop": lambda: keras.optimizers.RMSprop(1e-3), "adam": lambda: keras.optimizers.Adam(1e-3),
            "adagrad": lambda: keras.optimizers.Adagrad(1e-2),
            "sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9)}

    def build(name):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((args.length,), dtype="int32"),
                                      keras.layers.Embedding(args.vocab, args.dim),
                                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
            model.compile(make[name](), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=False)
        return model

    def batches():
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()
        return iter(strategy.experimental_distribute_dataset(data))

    def step(model, iterator) -> float:
        t0 = time.perf_counter()
        logs = model.train_function(iterator)
        logs = logs.get_value() if hasattr(logs, "get_value") else logs  # Keras' Optional, or torus' logs
        float(np.asarray(logs["loss"]))  # the step has finished
        return time.perf_counter() - t0

    def equal(model) -> bool:
        state = model.get_weights() + [np.asarray(v) for v in model.optimizer.variables]
        every = tc.comm.allgather(b"".join(np.ascontiguousarray(a).tobytes() for a in state))
        return all(blob == every[0] for blob in every)

    def median_ms(call) -> float:
        call()
        took = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            call()
            took.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(took))

    # The pieces the ways add, alone, on the first global batch's ids (every rank runs them: the broadcasts are
    # collective): reducing the gathered rows to unique indices, the scatter of repeated against unique rows, and
    # what "rows" and "whole" broadcast for a variable with one slot (RMSprop, Adagrad).
    rows = tf.IndexedSlices(tf.random.stateless_normal([first.size, args.dim], [1, 2]), tf.constant(first, tf.int64))
    table = tf.Variable(tf.zeros([args.vocab, args.dim]))
    unique = tf.function(lambda: sparse.unique_slices(rows))
    scatter = tf.function(lambda g: table.scatter_sub(g))
    deduped = unique()
    touched = np.zeros((2 * int(np.unique(first).size), args.dim), np.float32).view(np.uint8).reshape(-1)
    whole = np.zeros((2 * args.vocab, args.dim), np.float32).view(np.uint8).reshape(-1)
    parts = {"unique_slices": median_ms(lambda: unique()),
             "scatter repeated rows": median_ms(lambda: scatter(rows)),
             "scatter unique rows": median_ms(lambda: scatter(deduped)),
             "bcast touched rows x2": median_ms(lambda: tc.comm.Bcast(touched, root=0)),
             "bcast whole x2": median_ms(lambda: tc.comm.Bcast(whole, root=0))}

    results: dict = {}
    order = np.random.default_rng(1)
    for name in args.optimizers.split(","):
        models, iterators = {}, {}
        for way in ways:
            models[way] = model = build(name)
            if way in ("rows", "whole"):
                with_resync(model.optimizer, whole=way == "whole")
            tracing["way"] = way
            model.fit(x[:2 * args.batch], y[:2 * args.batch], batch_size=args.batch, verbose=0)  # traces its step
            strategy.broadcast_variables(model.variables + model.optimizer.variables)
            iterators[way] = batches()
            step(model, iterators[way])
        tracing["way"] = "scatter"
        took = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way in order.permutation(ways):
                took[way].append(step(models[way], iterators[way]))
        base = np.array(took["current"])
        reference = models["current"].get_weights()
        results[name] = {way: {"step_ms": 1e3 * float(np.median(took[way])),
                               "fastest_ms": 1e3 * float(np.min(took[way])),
                               "vs_current": float(np.median(np.array(took[way]) / base)),
                               "bitwise_equal": equal(models[way]),
                               "weights_from_current": max(float(np.max(np.abs(w - r))) for w, r in
                                                           zip(models[way].get_weights(), reference))}
                         for way in ways}
    if not strategy.is_chief:
        return
    out = {"command": f"mpiexec -n {tc.size} python {' '.join(sys.argv)}", "ranks": tc.size,
           "vocab": args.vocab, "dim": args.dim, "length": args.length, "global_batch": args.batch,
           "rounds": args.rounds, "gathered_rows": int(first.size), "unique_rows": int(np.unique(first).size),
           "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads() or "default",
           "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "load_avg_1min": os.getloadavg()[0], "parts_ms": parts, "results": results}
    print(f"{out['command']}\n{tc.size} ranks, vocab {args.vocab} x {args.dim}, global batch {args.batch} x "
          f"{args.length} ids: {out['gathered_rows']} gathered rows, {out['unique_rows']} unique (first batch); "
          f"{args.rounds} steps per way, interleaved; load {out['load_avg_1min']:.1f}")
    print(f"{'optimizer':<10} {'way':<8} {'step ms':>8} {'fastest':>8} {'x current':>10} {'bitwise equal':>14} "
          f"{'|w - current|':>14}")
    for name, by_way in results.items():
        for way, r in by_way.items():
            print(f"{name:<10} {way:<8} {r['step_ms']:>8.2f} {r['fastest_ms']:>8.2f} {r['vs_current']:>10.3f} "
                  f"{'yes' if r['bitwise_equal'] else 'NO':>14} {r['weights_from_current']:>14.2e}")
    print("alone (median of --reps calls, ms): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
