"""The torus-train job of bench/fault_injection/fault_injection.py (``--job train``): ``torus-train --model tiny-nobn``
on the embedded digits at 8x8 pixels, global batch 60 (23 steps an epoch, divisible by 1..6 ranks), ``FI_EPOCHS`` epochs
(default 12), SGD with momentum at 0.2 (the ResNet-50 recipe's LARS at 4.0 diverges on this model without batch
normalization, and a diverging run ends far apart at different rank counts), one thread per rank. Uninterrupted, 1, 2
and 3 ranks end within 1.5e-6 of each other (weights up to 2.1). Under torus-run it snapshots and resumes by itself
(app/snapshots.py); nothing here knows about faults. The same three bench additions as
bench/fault_injection/fault_job.py, all outside the training:

- ``FI_LOG``: rank 0 appends ``<unix time> <TORUS_RESTART> <optimizer step> <ranks>`` after every step;
- ``FI_PIDS``: every rank writes ``<folder>/<restart>-<rank>`` = ``<pid> <PMI_HOSTNAME>`` at start;
- ``FI_OUT``: rank 0 saves the final trainable weights (an .npz, ``w0``, ``w1``, ...).

``FI_MODEL=resnet50``: ResNet-50 on synthetic 32x32 images instead, global batch 12, 20 steps an epoch (per-rank
random data: for the recovery's timing, not its weights).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from torus.integrations.keras.app import cli, snapshots, trainer

EPOCHS = int(os.environ.get("FI_EPOCHS", "12"))
RESTART = os.environ.get("TORUS_RESTART", "-")
STEPS_PER_EPOCH = 1437 // 60


def main() -> int:
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if os.environ.get("FI_PIDS"):
        with open(os.path.join(os.environ["FI_PIDS"], f"{RESTART}-{rank}"), "w") as f:
            f.write(f"{os.getpid()} {os.environ.get('PMI_HOSTNAME', '?')}\n")
    offer = snapshots.Taker.after_step
    log = open(os.environ["FI_LOG"], "a") if rank == 0 and os.environ.get("FI_LOG") else None

    def after_step(self, epoch, done, steps, history):
        offer(self, epoch, done, steps, history)
        if log is not None:
            step = int(self.trainer.model.optimizer.iterations.numpy())
            log.write(f"{time.time():.3f} {RESTART} {step} {size}\n")
            log.flush()
    snapshots.Taker.after_step = after_step
    run = trainer.Trainer.run

    def run_and_save(self):
        summary = run(self)
        if self.rank == 0 and os.environ.get("FI_OUT"):
            np.savez(os.environ["FI_OUT"], **{f"w{k}": np.asarray(v.numpy())
                                              for k, v in enumerate(self.model.trainable_variables)})
        return summary
    trainer.Trainer.run = run_and_save
    if os.environ.get("FI_MODEL") == "resnet50":  # fault_injection.py --job resnet50: 20 steps an epoch
        model = ["--model", "resnet50", "--synthetic", "--image-size", "32", "--steps", "20", "--batch-schedule",
                 "0:12"]
    else:
        model = ["--model", "tiny-nobn", "--image-size", "8", "--batch-schedule", "0:60", "--optimizer", "sgd",
                 "--lr", "0.2", "--base-batch", "60"]
    return cli.main([*model, "--epochs", str(EPOCHS), "--warmup-epochs", "1", "--threads", "1", "--verbose", "0",
                     *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
