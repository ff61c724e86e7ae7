"""The ``torus-train`` trainer: builds the model, optimizer, data and strategy from the parsed command line
(``cli.parse_args``) and runs the epochs (``Trainer.run``): one ``model.fit`` epoch per batch size of the
schedule (or a custom loop with ``--trainer loop``), a global evaluation, batch-norm statistics averaged over
ranks and an atomic checkpoint on rank 0 each epoch, and under torus-run snapshots within epochs
(``app/snapshots.py``); ``summary_line`` is the run in one line.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from torus import knobs
from torus.integrations.keras.app.cli import RECIPE


def build_model(name: str, image_size: int, num_classes: int, bn_momentum: float, channels: int = 3):
    """ResNet-50 (random init, logits out), ResNet-20 (``resnet.py``) or a tiny CNN, with or without batch
    normalization (``tiny``, ``tiny-nobn``), for float32 images ``(batch, image_size, image_size, channels)``;
    batch-norm momentum set to ``bn_momentum``."""
    import keras
    shape = (image_size, image_size, channels)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=num_classes,
                                            classifier_activation=None)
    elif name == "resnet20":
        from torus.integrations.keras.app.resnet import resnet20
        model = resnet20(shape, num_classes)
    else:  # tiny-nobn: its result does not depend on how a global batch is split over ranks
        norm = [keras.layers.BatchNormalization()] if name == "tiny" else []
        model = keras.Sequential([
            keras.Input(shape), keras.layers.Conv2D(8, 3, strides=2, padding="same"), *norm,
            keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(num_classes)], name=name.replace("-", "_"))
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            # Keras' 0.99 lags far behind the weights in short runs: validation stays at chance for epochs
            layer.momentum = bn_momentum
    return model


def build_optimizer(args):
    """The ``--optimizer`` with learning rate 0 (``BatchControl`` sets it before every step): LARS (You et al.
    2017), SGD with momentum or Nesterov momentum, or Adam; Keras' ``weight_decay`` is decoupled (as AdamW)."""
    import keras

    from torus.integrations.keras.training.lars import LARS
    if args.optimizer == "lars":
        return LARS(0.0, momentum=args.momentum, trust_coefficient=args.trust, weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        return keras.optimizers.Adam(0.0, beta_1=args.momentum, weight_decay=args.weight_decay or None)
    return keras.optimizers.SGD(0.0, momentum=args.momentum, nesterov=args.optimizer == "nesterov",
                                weight_decay=args.weight_decay or None)


def _fit_ranks(schedule, epoch: int, size: int) -> None:
    """``ValueError`` naming the rank counts that work where ``size`` ranks do not divide ``epoch``'s global
    batch (a relaunch on fewer hosts can reach such a count)."""
    batch = schedule.global_batch(epoch)
    if batch % size:
        fits = [n for n in range(1, 2 * size + 1) if batch % n == 0]
        raise ValueError(f"torus-train: the global batch {batch} of epoch {epoch + 1} does not divide into {size} "
                         f"ranks; it does into {', '.join(map(str, fits))} ranks (up to {2 * size})")


class AgreedError(Exception):
    """Marks a failure every rank raised together (after :func:`_collective`), so ranks may leave cleanly."""


def _collective(comm, what: str, fn):
    """Run ``fn()`` on every rank; when it raises on any rank, raise ``DataError`` on all of them with one line
    naming each failing rank and its error, so no rank waits in a collective that a failed rank will never
    reach."""
    from torus.cli import JobError, agree
    from torus.integrations.keras.app.data import DataError

    class AgreedDataError(DataError, AgreedError):
        pass
    try:
        return agree(comm, what, fn, catch=(DataError, ValueError, OSError))
    except JobError as exc:
        raise AgreedDataError(str(exc)) from None


def _average_variables(comm, variables) -> None:
    """Replace float ``variables`` (batch-norm moving statistics) by their mean over ranks: each rank's
    statistics come from its own shard; averaging makes every rank's model, and so the checkpoint, one."""
    import numpy as np
    from mpi4py import MPI
    variables = [v for v in variables if "float" in str(v.dtype)]
    if comm.Get_size() == 1 or not variables:
        return
    flat = np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    flat /= comm.Get_size()
    offset = 0
    for v in variables:
        n = int(np.prod(v.shape))
        v.assign(flat[offset:offset + n].reshape(tuple(v.shape)).astype(v.dtype))
        offset += n


class StepClock:
    """Steady-state step timing: wall time from the end of an epoch's first step to the end of its last, so
    start-up, tracing and the first step (which retraces when the batch size changes) are left out."""

    def start_epoch(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.steps = 0

    def step_done(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.steps += 1
        self.last = now

    def seconds(self) -> float:
        """From the end of the epoch's first step to the end of its last (0 before a second step)."""
        return self.last - self.first if self.steps and self.first is not None and self.last is not None else 0.0

    def images_per_s(self, global_batch: int) -> float | None:
        return self.steps * global_batch / self.seconds() if self.steps else None


def _clock_callback(clock: StepClock):
    import keras
    return keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: clock.start_epoch(),
                                          on_train_batch_end=lambda batch, logs: clock.step_done())


def _launcher_terminal() -> bool:
    """Whether this rank's output ends on a terminal: its own stdout, or under a local ``mpiexec`` (which pipes
    the ranks' output) the launcher's. Unknown (a remote host, another launcher) counts as no terminal."""
    if sys.stdout.isatty():
        return True
    pid = os.getppid()
    for _ in range(3):  # rank -> hydra_pmi_proxy -> mpiexec
        try:
            proc = Path("/proc", str(pid))
            if (proc / "comm").read_text().strip().startswith(("mpiexec", "mpirun")):
                return os.path.realpath(proc / "fd" / "1").startswith(("/dev/pts/", "/dev/tty"))
            pid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _progress_bar(steps: int, desc: str, enabled: bool):
    """A tqdm bar on stdout for one epoch (cleared at its end; the epoch's line follows), or a no-op one."""
    from tqdm import tqdm
    return tqdm(total=steps, desc=desc, file=sys.stdout, leave=False, disable=not enabled, dynamic_ncols=True)


def _progress_callback(trainer):
    """Keras callback drawing rank 0's bar under ``model.fit`` (Keras' own progress is off: one ``fit`` call
    per epoch gives it wrong epoch headers, and it writes bars into log files)."""
    import keras

    class Progress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.bar = _progress_bar(trainer.epoch_steps, f"epoch {epoch + 1}/{trainer.args.epochs}", trainer.bar)

        def on_train_batch_end(self, batch, logs=None):
            self.bar.update(1)
            if logs and "loss" in logs and not self.bar.disable:
                self.bar.set_postfix(loss=f"{float(logs['loss']):.4f}", refresh=False)

        def on_epoch_end(self, epoch, logs=None):
            self.bar.close()
    return Progress()


class Trainer:
    """One ``torus-train`` run: data, model, strategy, the epoch loop, checkpoints and the summary."""

    def __init__(self, args, comm, threads: int):
        import keras
        from mpi4py import MPI

        from torus.integrations.keras.app import data, digits, idx
        from torus.integrations.keras.strategy import TorusStrategy
        from torus.integrations.keras.training.schedule import BatchSizeSchedule, LearningRateRule
        self.args, self.comm, self.threads = args, comm, threads
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        dims = tuple(int(n) for n in args.dims.lower().split("x")) if args.dims else None
        if args.timeline:
            knobs.override("TORUS_TIMELINE", args.timeline)
        self.strategy = TorusStrategy(dims=dims, algorithm=args.algorithm, compression=args.compression,
                                      comm=comm, overlap={"on": True, "off": False}.get(args.overlap),
                                      bucket_bytes=args.bucket_bytes, snapshot_steps=args.snapshot_every)
        self.schedule = BatchSizeSchedule(args.batch_schedule)
        self.lr_rule = LearningRateRule(args.lr, args.base_batch, args.warmup_epochs, "poly", args.epochs)
        self.root = args.data
        self.idx_root = _collective(comm, f"finding {args.data}", functools.partial(idx.locate, args.data)) \
            if args.data is not None and not args.synthetic else None
        # crops and flips are ImageNet's recipe; the digits and Fashion-MNIST train on the images as they are
        self.augment = data.Augment.parse(args.augment or ("crop,flip" if args.data and not self.idx_root
                                                           else "none"))
        self.channels = 3
        self.train_data: Any = None  # a data.Split; None with --synthetic, whose paths never read it
        self.min_count = 0
        if args.synthetic:
            self.num_classes = args.num_classes or 1000
        elif self.idx_root is not None:
            self.root = str(self.idx_root)
            self.train_split, self.val_split = _collective(comm, f"reading {self.root}", functools.partial(
                data.open_idx, self.idx_root, rank=self.rank, size=self.size))
            self.num_classes, self.min_count, self.train_data = idx.NUM_CLASSES, self.train_split.count, \
                self.train_split
            self.channels = 1
        else:
            if self.root is None:
                # rank 0 builds the set; ensure_digits' lock makes any rank safe, the barrier makes it once
                _collective(comm, "building the digits data",
                            lambda: digits.ensure_digits(args.image_size) if self.rank == 0 else None)
                self.root = str(digits.ensure_digits(args.image_size))
            self.train_split, self.val_split = (
                _collective(comm, f"reading {split} data from {self.root}", functools.partial(
                    data.open_split, self.root, split, rank=self.rank, size=self.size,
                    on_bad_image=args.on_bad_image, num_classes=args.num_classes))
                for split in ("train", "val"))
            self.num_classes = self.train_split.num_classes
            self.min_count = comm.allreduce(self.train_split.count, op=MPI.MIN)
            # training reads global batches (the same images at any rank count) where the layout allows
            self.train_data = data.shared_split(self.train_split, comm)
        if args.train_images is not None and not args.synthetic:
            self.train_data = _collective(comm, "choosing the training subset",
                                          lambda: data.subset(self.train_data, args.train_images))
        self.loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=args.label_smoothing)
        if args.trainer == "fit":
            with self.strategy.scope():
                self.model = self._compiled_model()
        else:
            self.model = self._compiled_model()

    def _compiled_model(self):
        import keras
        args = self.args
        model = build_model(args.model, args.image_size, self.num_classes, args.bn_momentum, self.channels)
        model.compile(build_optimizer(args), loss=self.loss, jit_compile=False,
                      metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")])
        model.optimizer.build(model.trainable_variables)
        return model

    def _steps(self, epoch: int) -> int:
        """Global steps in ``epoch``: global batches of the whole data (per-rank shards: of the smallest)."""
        from torus.integrations.keras.app import data
        if self.args.synthetic:
            return self.args.steps
        per_rank = self.schedule.per_rank_batch(epoch, self.size)
        steps = self.train_data.count // (per_rank * self.size) if self.train_data.shared \
            else self.min_count // per_rank
        if steps < 1:
            raise data.DataError(f"epoch {epoch}: the training data ({self.train_data.count} images"
                                 + ("" if self.train_data.shared else f", {self.min_count} in the smallest shard")
                                 + f") makes no global batch of {per_rank * self.size}")
        return steps

    def _train_data(self, epoch: int, per_rank: int, steps: int, skip: int = 0):
        import tensorflow as tf

        from torus.integrations.keras.app import data
        if self.args.synthetic:
            dataset = data.synthetic_dataset(batch_size=per_rank, steps=steps - skip,
                                             image_size=self.args.image_size, num_classes=self.num_classes,
                                             seed=self.args.seed + self.rank)
        else:
            dataset = data.train_dataset(self.train_data, epoch=epoch, batch_size=per_rank, steps=steps,
                                         image_size=self.args.image_size, augment=self.augment,
                                         seed=self.args.seed, rank=self.rank, size=self.size, skip=skip)
        num_classes = self.num_classes

        def one_hot(images, labels):
            return images, tf.one_hot(labels, num_classes)
        return dataset.map(one_hot)

    def _evaluate(self, dataset) -> tuple[float, float]:
        """Global top-1 and top-5 accuracy over every rank's part of ``dataset`` (exact counts, one
        ``MPI_Allreduce`` of three numbers)."""
        import numpy as np
        import tensorflow as tf
        from mpi4py import MPI
        if not hasattr(self, "_counts"):
            model = self.model

            @tf.function
            def counts(x, y):
                logits = tf.cast(model(x, training=False), tf.float32)
                top1 = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y)
                top5 = tf.math.in_top_k(y, logits, min(5, logits.shape[-1]))
                return tf.reduce_sum(tf.cast(top1, tf.float64)), tf.reduce_sum(tf.cast(top5, tf.float64))
            self._counts = counts
        total = np.zeros(3)
        for x, y in dataset:
            top1, top5 = self._counts(x, y)
            total += (len(y), float(top1), float(top5))
        self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total[1] / max(total[0], 1), total[2] / max(total[0], 1)

    def _resume(self) -> tuple[int, list]:
        from torus.integrations.keras.app import checkpoint
        args = self.args
        if not args.resume:
            return 0, []
        path = self.comm.bcast(checkpoint.latest(args.checkpoint_dir) if self.rank == 0 else None, root=0)
        if path is None:
            if self.rank == 0:
                print(f"torus-train: no checkpoint in {args.checkpoint_dir}; starting from epoch 0", flush=True)
            return 0, []
        state = checkpoint.restore(path, self.model)
        if self.rank == 0:
            print(f"torus-train: resumed from {path} after epoch {state['epoch']}", flush=True)
            saved = state.get("args", {})
            changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(args, k)}" for k in RECIPE
                       if k in saved and saved[k] != getattr(args, k)]
            if changed:  # legal (e.g. more epochs), but the run no longer continues the interrupted one exactly
                print("torus-train: warning: resuming with a changed recipe: " + ", ".join(changed), flush=True)
        return int(state["epoch"]), list(state["history"])

    def _callbacks(self):
        import keras

        from torus.integrations.keras.app import snapshots
        from torus.integrations.keras.training.callbacks import BatchControl
        self.batch_control = BatchControl(self.schedule, self.lr_rule, lambda epoch: self.epoch_steps)
        callbacks = self.strategy.callbacks() + [self.batch_control, _clock_callback(self.clock),
                                                 _progress_callback(self), snapshots.fit_callback(self)]
        logs = self.args.tensorboard or (self.args.checkpoint_dir and os.path.join(self.args.checkpoint_dir, "logs"))
        if logs and self.rank == 0:
            callbacks.append(keras.callbacks.TensorBoard(logs, update_freq="epoch"))
        return callbacks

    def _fit_epoch(self, dataset, epoch: int, steps: int, callbacks) -> dict:
        self.batch_control.skip = self.skip
        with warnings.catch_warnings():
            # Per-rank batch-norm statistics are this recipe's choice (each rank normalizes its own batch, as
            # Goyal et al. 2017 compute them per worker); the strategy's warning is for users
            # who did not choose them.
            warnings.filterwarnings("ignore", message="TorusStrategy: BatchNormalization layers")
            history = self.model.fit(dataset, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=steps - self.skip,
                                     shuffle=False, callbacks=callbacks, verbose=0)
        return {k: float(v[-1]) for k, v in history.history.items()}

    def _loop_epoch(self, dataset, epoch: int, steps: int) -> dict:
        """One epoch of the custom GradientTape loop: fused all-reduce of the gradients (``loop.py``), the
        learning rate set before every step from the same rule ``BatchControl`` applies under fit."""
        import numpy as np
        import tensorflow as tf
        from mpi4py import MPI
        model, optimizer = self.model, self.model.optimizer
        if not hasattr(self, "_step"):
            self.strategy.broadcast_variables(list(model.variables) + list(optimizer.variables))

            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    logits = tf.cast(model(x, training=True), tf.float32)
                    loss = self.loss(y, logits)
                grads = self.strategy.allreduce_gradients(tape.gradient(loss, model.trainable_variables))
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                correct = tf.equal(tf.argmax(logits, -1), tf.argmax(y, -1))
                return loss, tf.reduce_sum(tf.cast(correct, tf.float64))
            self._step = step
        global_batch = self.schedule.global_batch(epoch)
        sums = np.zeros(3)
        bar = _progress_bar(steps, f"epoch {epoch + 1}/{self.args.epochs}", self.bar)
        self.clock.start_epoch()
        for batch, (x, y) in enumerate(dataset, start=self.skip):
            optimizer.learning_rate = self.lr_rule.lr(epoch + batch / steps, global_batch)
            loss, correct = self._step(x, y)
            self.clock.step_done()
            self.snapshot_taker.after_step(epoch, batch + 1, steps, self.history)
            sums += (len(y) * float(loss), float(correct), len(y))
            bar.update(1)
            bar.set_postfix(loss=f"{sums[0] / sums[2]:.4f}", accuracy=f"{sums[1] / sums[2]:.4f}", refresh=False)
        bar.close()
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        return {"loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2], "global_batch": global_batch,
                "learning_rate": float(np.asarray(optimizer.learning_rate))}

    def run(self) -> dict:
        from torus.integrations.keras.app import checkpoint, data, snapshots
        args = self.args
        for epoch in range(args.epochs):  # before any step: a rank count that fits no epoch's batch
            _fit_ranks(self.schedule, epoch, self.size)
        epoch, history = self._resume()
        position = snapshots.resume(self, snapshots.Position(epoch, 0, history))
        start, self.skip, self.history = position.epoch, position.skip, position.history
        history = self.history
        self.snapshot_taker = snapshots.Taker(self)
        self.clock = StepClock()
        # rank 0's bar only where a person watches (a terminal), never in a log file
        self.bar = self.rank == 0 and args.verbose == 1 and _launcher_terminal()
        callbacks = self._callbacks() if args.trainer == "fit" else None
        t_start = time.perf_counter()
        for epoch in range(start, args.epochs):
            global_batch = self.schedule.global_batch(epoch)
            per_rank = self.schedule.per_rank_batch(epoch, self.size)
            steps = self._steps(epoch)
            self.epoch, self.epoch_steps = epoch, steps
            dataset = self._train_data(epoch, per_rank, steps, self.skip)
            t0 = time.perf_counter()
            comm0, exposed0 = self.strategy.host.comm_seconds()
            logs = self._fit_epoch(dataset, epoch, steps, callbacks) if args.trainer == "fit" \
                else self._loop_epoch(dataset, epoch, steps)
            seconds = time.perf_counter() - t0
            comm_s, exposed_s = (b - a for a, b in zip((comm0, exposed0), self.strategy.host.comm_seconds()))
            _average_variables(self.comm, self.model.non_trainable_variables)
            record = {"epoch": epoch + 1, "global_batch": global_batch, "steps": steps, "seconds": seconds,
                      "images_per_s": self.clock.images_per_s(global_batch) or steps * global_batch / seconds,
                      "timed_steps": self.clock.steps, "timed_seconds": self.clock.seconds(),
                      "loss": logs["loss"],
                      "accuracy": logs["accuracy"], "learning_rate": logs.get("learning_rate"),
                      "allreduce_s": comm_s, "exposed_s": min(exposed_s, comm_s),  # a wait's own call, tiny buckets
                      "overlap": max(0.0, 1 - exposed_s / comm_s) if comm_s > 0 else None}
            if not args.synthetic:
                val = data.val_dataset(self.val_split, batch_size=max(per_rank, 64), image_size=args.image_size,
                                       central_fraction=0.875 if args.data and not self.idx_root else 1.0)
                record["val_top1"], record["val_top5"] = self._evaluate(val)
            history.append(record)
            if self.rank == 0 and args.verbose:
                print("epoch {epoch}/{n}: batch {global_batch}, loss {loss:.4f}, accuracy {accuracy:.4f}, "
                      "{images_per_s:.1f} images/s, gradient all-reduce {allreduce_s:.2f} s (exposed "
                      "{exposed_s:.2f} s)".format(n=args.epochs, **record)
                      + (", val top-1 {val_top1:.4f}, top-5 {val_top5:.4f}".format(**record)
                         if "val_top1" in record else ""), flush=True)
            if self.rank == 0 and args.checkpoint_dir:
                checkpoint.save(args.checkpoint_dir, epoch + 1, self.model,
                                {"epoch": epoch + 1, "history": history, "args": vars(args)})
            self.skip = 0
            self.snapshot_taker.after_epoch(epoch, history)
        if self.strategy.timeline is not None and args.trainer == "loop":  # fit saves it itself
            self.strategy.timeline.save()
        return self._summary(history, time.perf_counter() - t_start, start + 1 if start or position.step else None)

    def _summary(self, history: list, seconds: float, resumed_epoch: int | None = None) -> dict:
        args = self.args
        images = sum(r.get("timed_steps", 0) * r["global_batch"] for r in history)
        timed = sum(r.get("timed_seconds", 0.0) for r in history)
        last = history[-1] if history else {}
        # time_s: this launch's; resumed_epoch: the epoch it started in after a resume (snapshot or checkpoint),
        # whose earlier epochs ran in other launches (epochs_s: every epoch's own time, whichever launch ran it)
        summary = {"time_s": round(seconds, 2), "epochs": len(history), "resumed_epoch": resumed_epoch,
                   "epochs_s": round(sum(r.get("seconds", 0.0) for r in history), 2),
                   "images_per_s": images / timed if images else None,
                   "val_top1": last.get("val_top1"), "val_top5": last.get("val_top5"),
                   "world_size": self.size, "algorithm": args.algorithm, "grid": list(self.strategy.torus_comm.dims),
                   "compression": args.compression, "trainer": args.trainer, "model": args.model,
                   "image_size": args.image_size, "data": "synthetic" if args.synthetic else self.root,
                   "threads_per_rank": self.threads, "overlap": self.strategy.host.overlap,
                   "bucket_bytes": self.strategy.host.bucket_bytes, "timeline": args.timeline,
                   "history": history}
        path = self.summary_path()
        if self.rank == 0 and path:
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
                f.write("\n")
        return summary

    def summary_path(self) -> str | None:
        """Where rank 0 writes the JSON summary: ``--summary``, else ``<checkpoint-dir>/summary.json``."""
        args = self.args
        return args.summary or (os.path.join(args.checkpoint_dir, "summary.json") if args.checkpoint_dir else None)


def summary_line(summary: dict) -> str:
    """The run in one labelled line, for people (the JSON file has every figure)."""
    val = "" if summary["val_top1"] is None else \
        f"val top-1 {summary['val_top1']:.4f}, top-5 {summary['val_top5']:.4f}, "
    speed = "" if summary["images_per_s"] is None else f"{summary['images_per_s']:.1f} images/s, "
    grid = "x".join(map(str, summary["grid"]))
    launch = "" if summary.get("resumed_epoch") is None else \
        f" (this launch, from epoch {summary['resumed_epoch']}; epochs' own times {summary['epochs_s']:.0f} s in all)"
    return (f"torus-train: done: {summary['epochs']} epochs in {summary['time_s']:.0f} s{launch}, {val}{speed}"
            f"{summary['world_size']} ranks (grid {grid}, {summary['algorithm']}), {summary['model']} at "
            f"{summary['image_size']}x{summary['image_size']}, {summary['trainer']}")


