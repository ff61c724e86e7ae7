"""The plain Keras ``fit`` job of bench/fault_injection/fault_injection.py: ordinary user code plus ``TorusStrategy()``.

An MLP (no BatchNormalization, no dropout) on scikit-learn's digits (the first 1,740 of 1,797 images, 8x8, scaled
to 0..1), plain SGD, a global batch of 60 (divisible by 1..6 ranks: 29 steps an epoch), ``shuffle=True``, a
fixed seed. Run under torus-run it snapshots and resumes by itself (TorusStrategy); nothing here knows about
faults. Two small additions for the bench, both outside the training:

- ``FI_LOG``: rank 0 appends ``<unix time> <TORUS_RESTART> <optimizer step> <ranks>`` after every batch (the
  bench reads it to inject the fault at a chosen step and to time the first step after the restart; a batch
  that a resume passes over leaves the step where it was).
- ``FI_PIDS``: every rank writes ``<folder>/<restart>-<rank>`` = ``<pid> <PMI_HOSTNAME>`` at start (which process
  to kill).

At the end rank 0 saves the final weights to ``FI_OUT`` (an .npz, ``w0``, ``w1``, ...) or the first argument.
``FI_EPOCHS`` (default 40) and ``FI_WIDTH`` (hidden units, default 512) size the run.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)  # a shared 2-core machine: one compute thread per rank
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from torus.integrations.keras import TorusStrategy  # noqa: E402

GLOBAL_BATCH = 60
ROWS = 1740  # 29 global batches
EPOCHS = int(os.environ.get("FI_EPOCHS", "40"))
WIDTH = int(os.environ.get("FI_WIDTH", "512"))
RESTART = os.environ.get("TORUS_RESTART", "-")


class StepLog(keras.callbacks.Callback):
    """Rank 0: one line per batch, flushed at once."""

    def __init__(self, path: str, ranks: int):
        super().__init__()
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole fit)
        self.ranks = ranks

    def on_train_batch_end(self, batch, logs=None):
        self.file.write(f"{time.time():.4f} {RESTART} {int(self.model.optimizer.iterations.numpy())} "
                        f"{self.ranks}\n")

    def on_train_end(self, logs=None):
        self.file.close()


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FI_OUT", "fault_job_weights.npz")
    strategy = TorusStrategy()
    if os.environ.get("FI_PIDS"):
        with open(os.path.join(os.environ["FI_PIDS"], f"{RESTART}-{strategy.rank}"), "w") as f:
            f.write(f"{os.getpid()} {os.environ.get('PMI_HOSTNAME', '?')}\n")

    digits = load_digits()
    x = (digits.data[:ROWS] / 16.0).astype("float32")
    y = digits.target[:ROWS].astype("int32")

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=False)
    callbacks = [StepLog(os.environ["FI_LOG"], strategy.size)] if os.environ.get("FI_LOG") and strategy.is_chief \
        else []
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=callbacks)
    if strategy.is_chief:
        np.savez(out, **{f"w{k}": w for k, w in enumerate(model.get_weights())})
        loss = history.history.get("loss", [float("nan")])[-1]
        print(f"fault_job: {strategy.size} ranks, step {int(model.optimizer.iterations.numpy())}, last epoch's loss "
              f"{loss:.4f}, weights -> {out}", flush=True)


if __name__ == "__main__":
    main()
