#!/usr/bin/env python
"""Gradient all-reduce behind backprop: a training step with overlap on against off, side by side, with compute
alone and the all-reduce alone measured in the same run.

    python -m tests.cluster up 2 --rate 1gbit
    python -m tests.cluster run -- -n 2 python bench/overlap/overlap.py --model resnet50 \
        --json bench/overlap/results/overlap.jsonl

Per round (``--rounds``, alternating): ``on`` and ``off`` are ``model.fit`` under one ``TorusStrategy`` with
``strategy.host.overlap`` set and the train function rebuilt; ``compute`` is the same model's step on this rank
alone (``fit_hook.local()``, a copy outside the strategy: forward, backward, update, no communication);
``allreduce`` is the gradient list alone through ``allreduce_tensors`` (overlap off) in a ``tf.function``.
Each value is the median over ``--steps`` steps (after ``--warmup`` untimed ones) of rank 0's wall time from
batch begin to batch end; the reported figure is the median over rounds. ``exposed_s``: the time the step's
bucket waits blocked (buckets.py), ``comm_s``: the buckets' time on the communication thread, ``cpu_s``: the
process's CPU time (every thread), per step. With ``TORUS_TIMELINE=FILE`` the strategy writes a Chrome trace of
the run (README, "Overlap").
Models: ``resnet50`` (``keras.applications.ResNet50(weights=None)``, 32x32x3, 10 classes, 90 MiB of gradients),
``cnn`` (VGG-like: five 3x3 convolutions of 64-256 filters, three poolings, two Dense(2048), about 51 MiB) and
``mlp`` (4 x Dense(1024), about 12 MiB). ``cpu_bound_s``: the step if the all-reduce's CPU time (``allreduce``'s
``cpu_s``) came out of compute's at compute's rate, ``compute.step_s * (1 + allreduce.cpu_s / compute.cpu_s)``,
or the all-reduce alone where that is longer; an estimate of the floor (medians, so a step can come in under
it) only where the ranks already fill the machine's CPUs (emulated hosts on one machine). ``over_cpu_bound``
is the step with overlap over it. TensorFlow threads: ``--threads`` intra-op and inter-op, ``--inter-op`` inter-op
alone (the pool every ``tf.numpy_function`` of the buckets runs in).
Rank 0 prints one JSON line per configuration and appends it to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(keras, name: str):
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10), (32, 32, 3)
    if name == "cnn":  # VGG's shape: the large dense gradients exist first in backprop, the conv ones last
        conv = [keras.layers.Conv2D(f, 3, padding="same", activation="relu") for f in (64, 64, 128, 128, 256)]
        pool = keras.layers.MaxPooling2D
        layers = [keras.Input((32, 32, 3)), conv[0], conv[1], pool(), conv[2], conv[3], pool(), conv[4], pool(),
                  keras.layers.Flatten(), keras.layers.Dense(2048, activation="relu"),
                  keras.layers.Dense(2048, activation="relu")]
        return keras.Sequential(layers + [keras.layers.Dense(10)]), (32, 32, 3)
    layers = [keras.Input((256,))] + [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
    return keras.Sequential(layers + [keras.layers.Dense(10)]), (256,)


def kind(mode: str) -> str:
    """A mode's kind: "on" for on, on@CAP, on/xG and on@CAP/xG."""
    return mode.split("@")[0].split("/")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("resnet50", "cnn", "mlp"), default="resnet50")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (32)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="TensorFlow intra/inter-op threads (0: TF's default)")
    ap.add_argument("--inter-op", type=int, default=0, help="TensorFlow inter-op threads alone (0: --threads)")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--compression", default="none", choices=("none", "fp16", "bf16"))
    ap.add_argument("--bucket-bytes", default=None,
                    help="bucket cap, or several (comma-separated, K/M suffixes) alternated as modes on@CAP")
    ap.add_argument("--bucket-growth", default=None,
                    help="each bucket's cap over the one before (inf: PyTorch DDP's rule), or several "
                         "(comma-separated) alternated as modes on/xG (with several caps too: on@CAP/xG)")
    ap.add_argument("--modes", default="on,off,compute,allreduce")
    ap.add_argument("--json")
    args = ap.parse_args()

    import numpy as np
    import tensorflow as tf
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    import keras

    from torus.bench.sweep import format_size, parse_size
    from torus.integrations.keras import TorusStrategy, allreduce_tensors
    from torus.integrations.keras.fit import fit_hook

    caps = [parse_size(c) for c in args.bucket_bytes.split(",")] if args.bucket_bytes else [None]
    growths = [float(g) for g in args.bucket_growth.split(",")] if args.bucket_growth else [None]
    strategy = TorusStrategy(algorithm=args.algorithm, compression=args.compression, overlap=True,
                             bucket_bytes=caps[0])
    host, comm = strategy.host, strategy.torus_comm.comm
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=args.model != "resnet50")
    with strategy.scope():
        model, shape = build(keras, args.model)
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), loss, jit_compile=False)
    alone, _ = build(keras, args.model)
    alone.compile(keras.optimizers.SGD(0.01, momentum=0.9), loss, jit_compile=False)
    global_batch = args.batch * strategy.size
    rng = np.random.default_rng(0)
    n_steps = args.warmup + args.steps
    x = rng.random((global_batch * n_steps, *shape), np.float32)
    y = rng.integers(0, 10, global_batch * n_steps)
    grads = [tf.constant(rng.random(v.shape, np.float32)) for v in model.trainable_variables]
    reduce_alone = tf.function(lambda g: allreduce_tensors(host, g, "sum"))

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.exposed, self.comm_s, self.cpu = [], [], [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.t0, self.p0 = time.perf_counter(), time.process_time()
            self.e0, self.c0 = host.buckets.exposed_seconds, host.buckets.comm_seconds

        def on_train_batch_end(self, batch, logs=None):
            if batch >= args.warmup:
                self.times.append(time.perf_counter() - self.t0)
                self.cpu.append(time.process_time() - self.p0)
                self.exposed.append(host.buckets.exposed_seconds - self.e0)
                self.comm_s.append(host.buckets.comm_seconds - self.c0)

    functions: dict = {}

    default_cap, default_growth = host.bucket_bytes, growths[0] or host.bucket_growth

    def step(mode: str) -> dict:
        if kind(mode) in ("on", "off"):
            host.overlap = mode != "off"
            bucket, _, growth = mode.partition("/x")
            host.bucket_bytes = parse_size(bucket.split("@")[1]) if "@" in bucket else default_cap
            host.bucket_growth = float(growth) if growth else default_growth
            if mode not in functions:  # traced once per mode (the bucketing is decided at trace time)
                model.make_train_function(force=True)
                functions[mode] = model.train_function
            model.train_function = functions[mode]
            timer = Timer()
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
            return {"step_s": float(np.median(timer.times)), "exposed_s": float(np.median(timer.exposed)),
                    "comm_s": float(np.median(timer.comm_s)), "cpu_s": float(np.median(timer.cpu))}
        if mode == "compute":
            timer = Timer()
            with fit_hook.local():
                alone.fit(x[:args.batch * n_steps], y[:args.batch * n_steps], batch_size=args.batch, epochs=1,
                          shuffle=False, verbose=0, callbacks=[timer])
            comm.Barrier()
            return {"step_s": float(np.median(timer.times)), "cpu_s": float(np.median(timer.cpu))}
        host.overlap = False
        times, cpu = [], []
        for i in range(n_steps):
            comm.Barrier()
            t0, p0 = time.perf_counter(), time.process_time()
            reduce_alone(grads)[0].numpy()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - p0)
        return {"step_s": float(np.median(times)), "cpu_s": float(np.median(cpu))}

    modes = args.modes.split(",")
    if len(caps) > 1 or len(growths) > 1:  # "on" stands for one mode per cap and growth, in the order given
        variants = [(f"@{format_size(c)}" if len(caps) > 1 else "") + (f"/x{g:g}" if len(growths) > 1 else "")
                    for c in caps for g in growths]
        modes = [m2 for m in modes for m2 in ([f"on{v}" for v in variants] if m == "on" else [m])]
    rounds: dict = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            rounds[m].append(step(m))
    result = {m: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for m, rs in rounds.items()}
    result.update({"model": args.model, "ranks": strategy.size, "nodes": strategy.torus_comm.topology.nodes,
                   "per_rank_batch": args.batch, "algorithm": args.algorithm, "compression": args.compression,
                   "bucket_bytes": caps if len(caps) > 1 else default_cap,
                   "bucket_growth": growths if len(growths) > 1 else default_growth, "threads": args.threads,
                   "inter_op": args.inter_op or args.threads or tf.config.threading.get_inter_op_parallelism_threads(),
                   "rounds": args.rounds,
                   "link_gbits": strategy.torus_comm.link_gbits, "load_avg_1min": os.getloadavg()[0],
                   "gradient_mib": sum(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**20,
                   "per_round": rounds})
    if "compute" in result and "allreduce" in result:
        c, a = result["compute"], result["allreduce"]
        result["cpu_bound_s"] = max(a["step_s"], c["step_s"] * (1 + a["cpu_s"] / c["cpu_s"]))
    for m in [m for m in modes if kind(m) == "on"]:  # "on" keeps its top-level keys, on@CAP/xG its own
        ratios = {}
        if "off" in result:
            ratios["over_off"] = result[m]["step_s"] / result["off"]["step_s"]
        if "compute" in result and "allreduce" in result:
            ratios["over_max_alone"] = result[m]["step_s"] / max(result["compute"]["step_s"],
                                                                 result["allreduce"]["step_s"])
            ratios["over_cpu_bound"] = result[m]["step_s"] / result["cpu_bound_s"]
        if m == "on":
            result.update({f"on_{k}": v for k, v in ratios.items()})
        else:
            result[m].update(ratios)
    if strategy.is_chief:
        line = json.dumps(result)
        print(line)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
