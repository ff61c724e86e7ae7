"""How far N ranks drift from one process on the same global batches, and how far one process drifts from itself
when it sums the same gradient in another order: the float spread that "equal to one process" means.

Under ``mpiexec -n N``: a 64 -> 256 -> 128 -> 10 MLP on scikit-learn's digits, SGD 0.05 with momentum 0.9, global
batch 48, ``shuffle=False`` (so every run sees the same batches), from the same initial weights, trained three
ways on every rank:

- ``torus``: ``model.fit`` under ``TorusStrategy`` (each rank computes the gradient of its 1/N of the batch);
- ``one``: plain Keras in one process on the global batch (the reference);
- ``halves``: one process whose step sums the gradients of the two halves of each batch (the all-reduce of 2
  ranks, without MPI): the spread that reordering the sum alone gives.

After each epoch, rank 0 prints the largest |weight difference| against ``one`` (``max|w|`` for scale), the
loss difference, and whether the ranks' weights are bitwise equal; one JSON line per epoch goes to ``--out``.

    mpiexec -n 2 python bench/float_spread/float_spread.py --epochs 20 \
        --out bench/float_spread/results/float_spread.jsonl
"""
from __future__ import annotations

import argparse
import json

import keras
import numpy as np
import tensorflow as tf
from mpi4py import MPI
from sklearn.datasets import load_digits

from torus.integrations.keras import TorusStrategy
from torus.integrations.keras.fit import fit_hook


def mlp():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


class Halves(keras.Sequential):
    """One process; the step's gradient is the sum of the two half-batches' gradients (each loss halved)."""

    def train_step(self, data):
        x, y = data
        half = tf.shape(x)[0] // 2
        grads = None
        for lo, hi in ((0, half), (half, tf.shape(x)[0])):
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x[lo:hi], y=y[lo:hi], y_pred=self(x[lo:hi], training=True)) / 2
            g = tape.gradient(loss, self.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss * 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON lines, one per epoch (rank 0)")
    args = ap.parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(2)
    world = MPI.COMM_WORLD
    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32")[:1776], digits.target[:1776]  # 37 batches of 48
    strategy = TorusStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp()
    w0 = [w.copy() for w in model.get_weights()]
    with fit_hook.local():
        one = mlp()
        halves = Halves(mlp().layers)
        halves.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                       keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    one.set_weights(w0)
    halves.set_weights(w0)
    out = open(args.out, "a") if args.out and world.rank == 0 else None
    steps = 0
    for epoch in range(args.epochs):
        loss = model.fit(x, y, batch_size=48, shuffle=False, verbose=0).history["loss"][-1]
        with fit_hook.local():
            ref = one.fit(x, y, batch_size=48, shuffle=False, verbose=0).history["loss"][-1]
            halves.fit(x, y, batch_size=48, shuffle=False, verbose=0)
        steps += len(x) // 48
        mine, want = model.get_weights(), one.get_weights()
        blob = b"".join(w.tobytes() for w in mine)
        row = {"ranks": world.size, "epoch": epoch + 1, "steps": steps,
               "bitwise_across_ranks": all(b == blob for b in world.allgather(blob)),
               "max_abs_w": max(float(np.abs(w).max()) for w in want),
               "torus_vs_one": max(float(np.abs(a - b).max()) for a, b in zip(mine, want)),
               "halves_vs_one": max(float(np.abs(a - b).max()) for a, b in zip(halves.get_weights(), want)),
               "loss_torus_vs_one": abs(loss - ref)}
        if world.rank == 0:
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
