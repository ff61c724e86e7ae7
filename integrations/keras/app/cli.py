"""``torus-train``: data-parallel ResNet-50 training under ``mpiexec`` (Mikami et al. 2018, arXiv:1811.05233).

``mpiexec -n 2 torus-train`` with no arguments trains ResNet-50 on the embedded digits set (see
``digits.py``; README.md shows a run); ``--data DIR`` reads an ILSVRC2012 folder tree or ImageNet
TFRecords (see ``data.py``), ``--data fashion-mnist`` Fashion-MNIST's idx files (``idx.py``). Each epoch runs
``model.fit`` for one epoch with that epoch's batch size from the batch-size schedule (the dataset is re-batched
at epoch boundaries, every rank runs the same number of steps), then evaluates top-1/top-5 on the whole
validation set (exact global counts), averages batch-norm moving statistics over ranks and, on rank 0, writes
an atomic checkpoint. Rank 0 prints one line per epoch (with a progress bar while the output is a terminal),
writes TensorBoard logs and, at the end, prints a labelled summary line and writes the JSON summary to
``--summary`` or ``<checkpoint-dir>/summary.json``.

Every argument is checked before TensorFlow is imported (a usage error is one line from rank 0, exit status
2); failures every rank reaches together are one line naming the ranks (exit status 1); a rank failing alone
prints one line and aborts the job (``--debug`` adds tracebacks and TensorFlow's start-up log).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

from torus.schedules import registry

# The recipe for the embedded digits (ResNet-50 at 32x32, 2 ranks): LARS with a 1-epoch warm-up, batch 64 then
# 128 (the linear rule doubles the peak rate with it), poly decay, batch-norm momentum 0.9. Measured: validation
# top-1 0.91 after epoch 5, 0.97 after 6, 0.986 after 10 (plain SGD at batch 64 needs 19 epochs for 0.90).
DEFAULTS = {
    "epochs": 10, "batch_schedule": "0:64,5:128", "optimizer": "lars", "lr": 4.0, "base_batch": 256,
    "warmup_epochs": 1.0, "momentum": 0.9, "weight_decay": 5e-5, "trust": 0.01, "label_smoothing": 0.1,
    "bn_momentum": 0.9, "image_size": 32,
}


RECIPE = ("model", "image_size", "epochs", "batch_schedule", "optimizer", "lr", "base_batch", "warmup_epochs",
           "momentum", "weight_decay", "trust", "label_smoothing", "bn_momentum", "augment", "seed", "train_images")


_DESCRIPTION = """\
Data-parallel ResNet-50 training under mpiexec (Mikami et al. 2018, arXiv:1811.05233).

With no --data it trains on the embedded digits set (scikit-learn's 1,797 real 8x8 scans, resized, written once
to ~/.cache/torus or $TORUS_CACHE); --data reads an ILSVRC2012 folder tree, ImageNet TFRecords, or
Fashion-MNIST (--data fashion-mnist: Debian's dataset-fashion-mnist package; --data DIR: a folder of its four
idx files; accuracy on its 10,000 test images). Each epoch trains with that epoch's batch from --batch-schedule,
then measures top-1/top-5 on the whole validation set.
Rank 0 prints one line per epoch and a summary; nothing is written unless --checkpoint-dir, --summary or
--tensorboard say where.

  mpiexec -n 2 torus-train                              # the digits, 10 epochs
  mpiexec -n 2 torus-train --data fashion-mnist --model resnet20 --batch-schedule 0:128
  mpiexec -n 4 torus-train --data /imagenet --image-size 224 --batch-schedule 0:256,5:512
"""


def parser() -> argparse.ArgumentParser:
    from torus.cli import ArgumentParser
    p = ArgumentParser(prog="torus-train", description=_DESCRIPTION)
    d = DEFAULTS
    p.add_argument("--data", metavar="DIR",
                   help="ILSVRC2012 folder tree (train/, val/), TFRecord folder, folder of the four idx files, or "
                   "fashion-mnist (/usr/share/datasets/fashion-mnist) (default: the embedded digits)")
    p.add_argument("--model", default="resnet50", choices=["resnet50", "resnet20", "tiny", "tiny-nobn"],
                   help="resnet50: keras.applications.ResNet50(weights=None); resnet20: He et al. 2016's CIFAR "
                   "ResNet-20; tiny: a small CNN for tests; tiny-nobn: the same without batch normalization (the "
                   "same result at any rank count)")
    p.add_argument("--image-size", type=int, metavar="PIXELS",
                   help=f"side of the square training and validation images (default: {d['image_size']}, 28 on "
                   "idx data except with resnet50, which needs at least 32)")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="epochs to train")
    p.add_argument("--batch-schedule", default=d["batch_schedule"], metavar="EPOCH:BATCH,...",
                   help="global batch (summed over ranks) from each 0-based epoch on; every batch must divide by "
                   "the rank count (for a large batch, start at a quarter of it and double it twice: docs/keras.md, "
                   "'Choosing a large batch')")
    p.add_argument("--optimizer", default=d["optimizer"], choices=["lars", "sgd", "nesterov", "adam"],
                   help="LARS, SGD with momentum, SGD with Nesterov momentum, or Adam (beta_1 = --momentum; "
                   "--weight-decay decoupled, as AdamW)")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate per --base-batch images "
                   "(linear scaling: the peak follows the global batch)")
    p.add_argument("--base-batch", type=int, default=d["base_batch"], metavar="N", help="batch --lr refers to")
    p.add_argument("--warmup-epochs", type=float, default=None, metavar="E",
                   help=f"linear warm-up from 0 to the peak rate, then poly decay (power 2) to 0 (default: "
                        f"{d['warmup_epochs']:g}, or half of --epochs where that is less)")
    p.add_argument("--momentum", type=float, default=d["momentum"], help="optimizer momentum")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"], help="L2 weight decay")
    p.add_argument("--trust", type=float, default=d["trust"], help="LARS trust coefficient")
    p.add_argument("--label-smoothing", type=float, default=d["label_smoothing"], help="cross-entropy smoothing")
    p.add_argument("--bn-momentum", type=float, default=d["bn_momentum"],
                   help="batch-norm moving-average momentum")
    p.add_argument("--mixed-precision", action="store_true", help="bfloat16 compute on CPU, float16 on GPU")
    p.add_argument("--algorithm", default="auto",
                   choices=[*registry.for_collective("allreduce"), "auto"],
                   help="all-reduce of the gradients (auto: by size and rank count, torus/select.py; the choices: "
                        "the registry's, torus/schedules/registry.py)")
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
    p.add_argument("--snapshot-every", type=int, metavar="STEPS",
                   help="under torus-run (or with TORUS_JOB_ID set): a snapshot every STEPS global steps, which a "
                   "relaunch resumes from at the next global batch (default: TORUS_SNAPSHOT_STEPS, else 500, "
                   "and every TORUS_SNAPSHOT_SECONDS; 0: none by steps)")
    p.add_argument("--summary", metavar="FILE", help="write the final summary (JSON) here "
                   "(default: <checkpoint-dir>/summary.json with --checkpoint-dir, else nowhere)")
    p.add_argument("--train-images", type=int, metavar="N",
                   help="train on N images of the training set (a fixed random subset, the same at any rank "
                   "count and seed) for quick runs; validation still reads the whole validation or test set")
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


def usage_error(message: str):
    from torus.cli import usage_error
    usage_error("torus-train", message)


def _check(p, args, size: int | None) -> None:
    """Every argument check that needs no data and no TensorFlow (so a bad one fails in about a second); with
    ``size`` (the rank count) also the grid and the batch schedule's divisibility."""
    from torus.cli import parse_dims, writable_file
    from torus.integrations.keras.app import idx
    from torus.integrations.keras.training.schedule import BatchSizeSchedule
    try:
        idx_root = idx.locate(args.data) if args.data is not None else None
    except idx.MissingData as exc:
        usage_error(str(exc))  # no "(see --help)": the line already says what to do
    if args.image_size is None:
        args.image_size = 28 if idx_root is not None and args.model != "resnet50" else DEFAULTS["image_size"]
    positive = {"epochs": args.epochs, "base_batch": args.base_batch, "steps": args.steps,
                "threads": args.threads, "image_size": args.image_size, "train_images": args.train_images}
    for name, value in positive.items():
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.model == "resnet50" and args.image_size < 32:
        p.error(f"--image-size {args.image_size}: ResNet-50 needs at least 32 pixels (--model tiny takes less)")
    if args.num_classes is not None and args.num_classes < 2:
        p.error(f"--num-classes {args.num_classes}: must be at least 2")
    if args.warmup_epochs is None:
        args.warmup_epochs = min(DEFAULTS["warmup_epochs"], args.epochs / 2)
    for name in ("lr", "weight_decay", "trust", "warmup_epochs"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name):g}: must be >= 0")
    for name in ("momentum", "label_smoothing", "bn_momentum"):
        if not 0 <= getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name):g}: must be in [0, 1)")
    if args.snapshot_every is not None and args.snapshot_every < 0:
        p.error(f"--snapshot-every {args.snapshot_every}: must be 0 or more steps")
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


def main(argv=None) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    args = parse_args(argv, size=comm.Get_size())  # before TensorFlow: a bad argument fails in a second
    from torus.integrations.keras.app.idx import KEYWORD
    if args.data is not None and args.data != KEYWORD and not os.path.isdir(args.data):
        # here, not in parse_args: Trainer reports it too (as DataError)
        usage_error(f"--data {args.data}: no such folder")
    threads = _configure_tensorflow(args, comm)
    from torus.cli import FAILED, abort_on_error
    from torus.integrations.keras.app.trainer import AgreedError, Trainer, summary_line
    if comm.Get_size() > 1:
        # An error on one rank must end the whole job: otherwise the other ranks wait in the next
        # collective until the stall timeout (torus.faults explains what hydra does on its own).
        abort_on_error(comm, "torus-train", args.debug)
    try:
        trainer = Trainer(args, comm, threads)
        summary = trainer.run()
    except AgreedError as exc:  # every rank raised it together: one line from rank 0, no abort needed
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
