"""``torus-train``: data-parallel ResNet-50 training under ``mpiexec`` (Mikami et al. 2018, arXiv:1811.05233).

``mpiexec -n 2 torus-train`` with no arguments trains ResNet-50 on the embedded digits set (see
``digits.py``) to over 90 % validation top-1; ``--data DIR`` reads an ILSVRC2012 folder tree or ImageNet
TFRecords (see ``data.py``). Each epoch runs ``model.fit`` for one epoch with that epoch's batch size from the
batch-size schedule (the dataset is re-batched at epoch boundaries, every rank runs the same number of steps),
then evaluates top-1/top-5 on the whole validation set (exact global counts), averages batch-norm moving
statistics over ranks and, on rank 0, writes an atomic checkpoint. Rank 0 prints one line per epoch (with a
progress bar while the output is a terminal), writes TensorBoard logs and, at the end, prints a labelled summary
line and writes the JSON summary to ``--summary`` or ``<checkpoint-dir>/summary.json``.

Every argument is checked before TensorFlow is imported (a usage error is one line from rank 0, exit status
2); failures every rank reaches together are one line naming the ranks (exit status 1); a rank failing alone
prints one line and aborts the job (``--debug`` adds tracebacks and TensorFlow's start-up log).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

# The recipe for the embedded digits (ResNet-50 at 32x32, 2 ranks): LARS with a 1-epoch warm-up, batch 64 then
# 128 (the linear rule doubles the peak rate with it), poly decay, batch-norm momentum 0.9. Measured: validation
# top-1 0.91 after epoch 5, 0.97 after 6, 0.986 after 10 (plain SGD at batch 64 needs 19 epochs for 0.90).
DEFAULTS = {
    "epochs": 10, "batch_schedule": "0:64,5:128", "optimizer": "lars", "lr": 4.0, "base_batch": 256,
    "warmup_epochs": 1.0, "momentum": 0.9, "weight_decay": 5e-5, "trust": 0.01, "label_smoothing": 0.1,
    "bn_momentum": 0.9, "image_size": 32,
}


_RECIPE = ("model", "image_size", "epochs", "batch_schedule", "optimizer", "lr", "base_batch", "warmup_epochs",
           "momentum", "weight_decay", "trust", "label_smoothing", "bn_momentum", "augment", "seed")


_DESCRIPTION = """\
Data-parallel ResNet-50 training under mpiexec (Mikami et al. 2018, arXiv:1811.05233).

With no --data it trains on the embedded digits set (scikit-learn's 1,797 real 8x8 scans, resized, written once
to ~/.cache/torus or $TORUS_CACHE); --data reads an ILSVRC2012 folder tree or ImageNet TFRecords. Each epoch
trains with that epoch's batch from --batch-schedule, then measures top-1/top-5 on the whole validation set.
Rank 0 prints one line per epoch and a summary; nothing is written unless --checkpoint-dir, --summary or
--tensorboard say where.

  mpiexec -n 2 torus-train                              # the digits, 10 epochs
  mpiexec -n 4 torus-train --data /imagenet --image-size 224 --batch-schedule 0:256,5:512
"""


def parser() -> argparse.ArgumentParser:
    from torus.cli import ArgumentParser
    p = ArgumentParser(prog="torus-train", description=_DESCRIPTION)
    d = DEFAULTS
    p.add_argument("--data", metavar="DIR",
                   help="ILSVRC2012 folder tree (train/, val/) or TFRecord folder (default: the embedded digits)")
    p.add_argument("--model", default="resnet50", choices=["resnet50", "tiny"],
                   help="resnet50: keras.applications.ResNet50(weights=None); tiny: a small CNN for tests")
    p.add_argument("--image-size", type=int, default=d["image_size"], metavar="PIXELS",
                   help="side of the square training and validation images (resnet50 needs at least 32)")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="epochs to train")
    p.add_argument("--batch-schedule", default=d["batch_schedule"], metavar="EPOCH:BATCH,...",
                   help="global batch (summed over ranks) from each 0-based epoch on; every batch must divide by "
                   "the rank count")
    p.add_argument("--optimizer", default=d["optimizer"], choices=["lars", "sgd"], help="LARS or SGD with momentum")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate per --base-batch images "
                   "(linear scaling: the peak follows the global batch)")
    p.add_argument("--base-batch", type=int, default=d["base_batch"], metavar="N", help="batch --lr refers to")
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"], metavar="E",
                   help="linear warm-up from 0 to the peak rate, then poly decay (power 2) to 0")
    p.add_argument("--momentum", type=float, default=d["momentum"], help="optimizer momentum")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"], help="L2 weight decay")
    p.add_argument("--trust", type=float, default=d["trust"], help="LARS trust coefficient")
    p.add_argument("--label-smoothing", type=float, default=d["label_smoothing"], help="cross-entropy smoothing")
    p.add_argument("--bn-momentum", type=float, default=d["bn_momentum"],
                   help="batch-norm moving-average momentum")
    p.add_argument("--mixed-precision", action="store_true", help="bfloat16 compute on CPU, float16 on GPU")
    p.add_argument("--algorithm", default="auto",
                   choices=["torus2d", "ring", "hierarchical", "swing", "native", "auto"],
                   help="all-reduce of the gradients (auto: by size and rank count, torus/select.py)")
    p.add_argument("--dims", metavar="XxY",
                   help="torus2d and swing grid, X*Y = the rank count (default: MPI_Dims_create's)")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"],
                   help="wire format of the gradients")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="all-reduce gradient buckets during backprop (auto: on across nodes; TORUS_OVERLAP)")
    p.add_argument("--bucket-bytes", type=int, metavar="N", help="gradient bucket cap (default 25 MiB)")
    p.add_argument("--timeline", metavar="FILE", help="write a Chrome trace of every rank's steps, buckets and "
                   "all-reduces here (TORUS_TIMELINE; open in ui.perfetto.dev)")
    p.add_argument("--trainer", default="fit", choices=["fit", "loop"],
                   help="keras Model.fit, or a GradientTape loop")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="rank 0 writes a checkpoint here after every epoch, "
                   "and summary.json at the end")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--summary", metavar="FILE", help="write the final summary (JSON) here "
                   "(default: <checkpoint-dir>/summary.json with --checkpoint-dir, else nowhere)")
    p.add_argument("--synthetic", action="store_true", help="time steps on random tensors (no data)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch with --synthetic")
    p.add_argument("--num-classes", type=int, metavar="N",
                   help="classes (default: from the data; 1000 with --synthetic)")
    p.add_argument("--augment", metavar="LIST",
                   help="comma list of crop[=area],flip,rotate[=deg],color[=d],noise[=sd] or none "
                   "(default: crop,flip with --data, none on the digits)")
    p.add_argument("--on-bad-image", default="skip", choices=["skip", "fail"],
                   help="an unreadable image: skip it with a warning, or stop")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the shuffles and the augmentation")
    p.add_argument("--threads", type=int, metavar="N",
                   help="TensorFlow intra-op threads per rank (default: cores / ranks on the node)")
    p.add_argument("--tensorboard", metavar="DIR", help="TensorBoard log folder (default: <checkpoint-dir>/logs "
                   "with --checkpoint-dir, else none)")
    p.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2],
                   help="rank 0's output: 0 the summary only, 1 a progress bar on a terminal and a line per epoch, "
                   "2 a line per epoch")
    p.add_argument("--debug", action="store_true",
                   help="show TensorFlow's start-up log and every failing rank's traceback")
    return p


def _check(p, args, size: int | None) -> None:
    """Every argument check that needs no data and no TensorFlow (so a bad one fails in about a second); with
    ``size`` (the rank count) also the grid and the batch schedule's divisibility."""
    from torus.cli import parse_dims, writable_file
    from torus.integrations.keras.schedule import BatchSizeSchedule
    positive = {"epochs": args.epochs, "base_batch": args.base_batch, "steps": args.steps,
                "threads": args.threads, "image_size": args.image_size}
    for name, value in positive.items():
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.model == "resnet50" and args.image_size < 32:
        p.error(f"--image-size {args.image_size}: ResNet-50 needs at least 32 pixels (--model tiny takes less)")
    if args.num_classes is not None and args.num_classes < 2:
        p.error(f"--num-classes {args.num_classes}: must be at least 2")
    for name in ("lr", "weight_decay", "trust", "warmup_epochs"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name):g}: must be >= 0")
    for name in ("momentum", "label_smoothing", "bn_momentum"):
        if not 0 <= getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name):g}: must be in [0, 1)")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.warmup_epochs >= args.epochs:
        p.error(f"--warmup-epochs {args.warmup_epochs:g} must be below --epochs {args.epochs} "
                "(the learning rate decays after the warm-up)")
    try:
        schedule = BatchSizeSchedule(args.batch_schedule)
        if args.dims:
            parse_dims(args.dims, size)
    except ValueError as e:
        p.error(str(e).replace("BatchSizeSchedule: ", "--batch-schedule: "))
    if size is not None:
        uneven = sorted({b for _, _, b in schedule.segments(args.epochs) if b % size})
        if uneven:
            p.error(f"--batch-schedule {args.batch_schedule}: global batch {', '.join(map(str, uneven))} does not "
                    f"divide into {size} ranks")
    for flag, path in (("--summary", args.summary), ("--timeline", args.timeline)):
        problem = writable_file(flag, path)
        if problem:
            p.error(problem)
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        p.error(f"--bucket-bytes {args.bucket_bytes}: must be at least 1")
    for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard)):
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            p.error(f"{flag} {folder}: exists and is not a folder")


def parse_args(argv=None, size: int | None = None) -> argparse.Namespace:
    """The command line as a namespace, every check of :func:`_check` passed; a usage error exits with
    status 2 after one line from rank 0. ``size`` is the rank count, for the checks that need it."""
    p = parser()
    args = p.parse_args(argv)
    _check(p, args, size)
    return args


def _local_size(comm) -> int:
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_size()
    finally:
        local.Free()


# TensorFlow's start-up notices (oneDNN, CPU features, absl's "before InitializeLog" line), printed by C++
# code during ``import tensorflow`` whatever TF_CPP_MIN_LOG_LEVEL says; warnings and errors still show.
_STARTUP_NOISE = re.compile(r"WARNING: All log messages before absl::InitializeLog|I\d{4} [\d:.]+ +\d+ \S+\] "
                            r"|To enable the following instructions")


def _import_tensorflow(debug: bool):
    """``import tensorflow, keras`` with the start-up notices left out (all of it shown with ``debug``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
    if debug or "tensorflow" in sys.modules:
        import keras
        import tensorflow as tf
        return tf, keras
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+b") as captured:
        os.dup2(captured.fileno(), 2)  # the notices come from C++, below sys.stderr
        try:
            import keras
            import tensorflow as tf
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines()
                    if line.strip() and not _STARTUP_NOISE.match(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
    return tf, keras


def _configure_tensorflow(args, comm):
    """Threads per rank (ranks on a node share its cores) and the precision policy; before any TF op."""
    tf, keras = _import_tensorflow(args.debug)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or max(1, cores // _local_size(comm))
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1 if threads == 1 else 2)
    except RuntimeError:  # TensorFlow already started in this process (main() called twice, as in tests)
        threads = tf.config.threading.get_intra_op_parallelism_threads()
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy(
            "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16")
    keras.utils.set_random_seed(args.seed)
    return threads


def build_model(name: str, image_size: int, num_classes: int, bn_momentum: float):
    """ResNet-50 (random init, logits out) or a tiny CNN; batch-norm momentum set to ``bn_momentum``."""
    import keras
    shape = (image_size, image_size, 3)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=num_classes,
                                            classifier_activation=None)
    else:
        model = keras.Sequential([
            keras.Input(shape), keras.layers.Conv2D(8, 3, strides=2, padding="same"),
            keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(num_classes)], name="tiny")
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            # Keras' 0.99 lags far behind the weights in short runs: validation stays at chance for epochs
            layer.momentum = bn_momentum
    return model


def build_optimizer(args):
    import keras

    from torus.integrations.keras.lars import LARS
    if args.optimizer == "lars":
        return LARS(0.0, momentum=args.momentum, trust_coefficient=args.trust, weight_decay=args.weight_decay)
    return keras.optimizers.SGD(0.0, momentum=args.momentum, weight_decay=args.weight_decay or None)


class _AgreedError(Exception):
    """Marks a failure every rank raised together (after :func:`_collective`), so ranks may leave cleanly."""


def _collective(comm, what: str, fn):
    """Run ``fn()`` on every rank; when it raises on any rank, raise ``DataError`` on all of them with one line
    naming each failing rank and its error, so no rank waits in a collective that a failed rank will never
    reach."""
    from torus.cli import JobError, agree
    from torus.integrations.keras.data import DataError

    class AgreedDataError(DataError, _AgreedError):
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
        self.first = self.last = None
        self.steps = 0

    def step_done(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.steps += 1
        self.last = now

    def images_per_s(self, global_batch: int) -> float | None:
        return self.steps * global_batch / (self.last - self.first) if self.steps else None


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

        from torus.integrations.keras import data, digits
        from torus.integrations.keras.schedule import BatchSizeSchedule, LearningRateRule
        from torus.integrations.keras.strategy import TorusStrategy
        self.args, self.comm, self.threads = args, comm, threads
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        dims = tuple(int(n) for n in args.dims.lower().split("x")) if args.dims else None
        if args.timeline:
            os.environ["TORUS_TIMELINE"] = args.timeline
        self.strategy = TorusStrategy(dims=dims, algorithm=args.algorithm, compression=args.compression,
                                      comm=comm, overlap={"on": True, "off": False}.get(args.overlap),
                                      bucket_bytes=args.bucket_bytes)
        self.schedule = BatchSizeSchedule(args.batch_schedule)
        self.lr_rule = LearningRateRule(args.lr, args.base_batch, args.warmup_epochs, "poly", args.epochs)
        self.augment = data.Augment.parse(args.augment or ("crop,flip" if args.data else "none"))
        self.root = args.data
        if args.synthetic:
            self.num_classes, self.min_count = args.num_classes or 1000, None
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
        self.loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=args.label_smoothing)
        if args.trainer == "fit":
            with self.strategy.scope():
                self.model = self._compiled_model()
        else:
            self.model = self._compiled_model()

    def _compiled_model(self):
        import keras
        args = self.args
        model = build_model(args.model, args.image_size, self.num_classes, args.bn_momentum)
        model.compile(build_optimizer(args), loss=self.loss, jit_compile=False,
                      metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")])
        model.optimizer.build(model.trainable_variables)
        return model

    def _train_data(self, epoch: int, per_rank: int, steps: int):
        import tensorflow as tf

        from torus.integrations.keras import data
        if self.args.synthetic:
            dataset = data.synthetic_dataset(batch_size=per_rank, steps=steps, image_size=self.args.image_size,
                                             num_classes=self.num_classes, seed=self.args.seed + self.rank)
        else:
            dataset = data.train_dataset(self.train_split, epoch=epoch, batch_size=per_rank, steps=steps,
                                         image_size=self.args.image_size, augment=self.augment,
                                         seed=self.args.seed, rank=self.rank)
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
        from torus.integrations.keras import checkpoint
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
            changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(args, k)}" for k in _RECIPE
                       if k in saved and saved[k] != getattr(args, k)]
            if changed:  # legal (e.g. more epochs), but the run no longer continues the interrupted one exactly
                print("torus-train: warning: resuming with a changed recipe: " + ", ".join(changed), flush=True)
        return int(state["epoch"]), list(state["history"])

    def _callbacks(self):
        import keras

        from torus.integrations.keras.callbacks import BatchControl
        callbacks = self.strategy.callbacks() + [BatchControl(self.schedule, self.lr_rule),
                                                 _clock_callback(self.clock), _progress_callback(self)]
        logs = self.args.tensorboard or (self.args.checkpoint_dir and os.path.join(self.args.checkpoint_dir, "logs"))
        if logs and self.rank == 0:
            callbacks.append(keras.callbacks.TensorBoard(logs, update_freq="epoch"))
        return callbacks

    def _fit_epoch(self, dataset, epoch: int, steps: int, callbacks) -> dict:
        with warnings.catch_warnings():
            # Per-rank batch-norm statistics are this recipe's choice (each rank normalizes its own batch, as
            # Goyal et al. 2017 compute them per worker); the strategy's warning is for users
            # who did not choose them.
            warnings.filterwarnings("ignore", message="TorusStrategy: BatchNormalization layers")
            history = self.model.fit(dataset, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=steps,
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
        for batch, (x, y) in enumerate(dataset):
            optimizer.learning_rate = self.lr_rule.lr(epoch + batch / steps, global_batch)
            loss, correct = self._step(x, y)
            self.clock.step_done()
            sums += (len(y) * float(loss), float(correct), len(y))
            bar.update(1)
            bar.set_postfix(loss=f"{sums[0] / sums[2]:.4f}", accuracy=f"{sums[1] / sums[2]:.4f}", refresh=False)
        bar.close()
        self.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        return {"loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2], "global_batch": global_batch,
                "learning_rate": float(np.asarray(optimizer.learning_rate))}

    def run(self) -> dict:
        from torus.integrations.keras import checkpoint, data
        args = self.args
        start, history = self._resume()
        self.clock = StepClock()
        # rank 0's bar only where a person watches (a terminal), never in a log file
        self.bar = self.rank == 0 and args.verbose == 1 and _launcher_terminal()
        callbacks = self._callbacks() if args.trainer == "fit" else None
        t_start = time.perf_counter()
        for epoch in range(start, args.epochs):
            global_batch = self.schedule.global_batch(epoch)
            per_rank = self.schedule.per_rank_batch(epoch, self.size)
            steps = args.steps if args.synthetic else self.min_count // per_rank
            if steps < 1:
                raise data.DataError(f"epoch {epoch}: the smallest rank's shard ({self.min_count} images) makes "
                                     f"no batch of {per_rank}")
            dataset = self._train_data(epoch, per_rank, steps)
            self.epoch_steps = steps
            t0 = time.perf_counter()
            comm0, exposed0 = self.strategy.host.comm_seconds()
            logs = self._fit_epoch(dataset, epoch, steps, callbacks) if args.trainer == "fit" \
                else self._loop_epoch(dataset, epoch, steps)
            seconds = time.perf_counter() - t0
            comm_s, exposed_s = (b - a for a, b in zip((comm0, exposed0), self.strategy.host.comm_seconds()))
            _average_variables(self.comm, self.model.non_trainable_variables)
            record = {"epoch": epoch + 1, "global_batch": global_batch, "steps": steps, "seconds": seconds,
                      "images_per_s": self.clock.images_per_s(global_batch) or steps * global_batch / seconds,
                      "timed_steps": self.clock.steps, "timed_seconds": self.clock.last - self.clock.first,
                      "loss": logs["loss"],
                      "accuracy": logs["accuracy"], "learning_rate": logs.get("learning_rate"),
                      "allreduce_s": comm_s, "exposed_s": min(exposed_s, comm_s),  # a wait's own call, tiny buckets
                      "overlap": max(0.0, 1 - exposed_s / comm_s) if comm_s > 0 else None}
            if not args.synthetic:
                val = data.val_dataset(self.val_split, batch_size=max(per_rank, 64), image_size=args.image_size,
                                       central_fraction=0.875 if args.data else 1.0)
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
        if self.strategy.timeline is not None and args.trainer == "loop":  # fit saves it itself
            self.strategy.timeline.save()
        return self._summary(history, time.perf_counter() - t_start)

    def _summary(self, history: list, seconds: float) -> dict:
        args = self.args
        images = sum(r.get("timed_steps", 0) * r["global_batch"] for r in history)
        timed = sum(r.get("timed_seconds", 0.0) for r in history)
        last = history[-1] if history else {}
        summary = {"time_s": round(seconds, 2), "epochs": len(history),
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
    return (f"torus-train: done: {summary['epochs']} epochs in {summary['time_s']:.0f} s, {val}{speed}"
            f"{summary['world_size']} ranks (grid {grid}, {summary['algorithm']}), {summary['model']} at "
            f"{summary['image_size']}x{summary['image_size']}, {summary['trainer']}")


def main(argv=None) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    args = parse_args(argv, size=comm.Get_size())  # before TensorFlow: a bad argument fails in a second
    if args.data is not None and not os.path.isdir(args.data):
        from torus.cli import usage_error  # here, not in parse_args: Trainer reports it too (as DataError)
        usage_error("torus-train", f"--data {args.data}: no such folder")
    threads = _configure_tensorflow(args, comm)
    from torus.cli import FAILED, abort_on_error
    if comm.Get_size() > 1:
        # An error on one rank must end the whole job: otherwise the other ranks wait in the next
        # collective until the stall timeout (torus.faults explains what hydra does on its own).
        abort_on_error(comm, "torus-train", args.debug)
    try:
        trainer = Trainer(args, comm, threads)
        summary = trainer.run()
    except _AgreedError as exc:  # every rank raised it together: one line from rank 0, no abort needed
        if comm.Get_rank() == 0:
            print(f"torus-train: error: {exc}", file=sys.stderr, flush=True)
        return FAILED
    if comm.Get_rank() == 0:
        print(summary_line(summary), flush=True)
        if trainer.summary_path():
            print(f"torus-train: summary written to {trainer.summary_path()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
