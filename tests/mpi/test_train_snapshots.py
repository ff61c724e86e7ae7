"""torus-train's snapshots (app/snapshots.py, issue 42): a run that loses its last rank mid-epoch (an exception
on every rank at a chosen step stands for the failure; the snapshots are on disk) is resumed by the ranks left,
and ends within float tolerance of the run that lost nothing: the same global batches (data.shared_split), the
same learning rates (BatchControl.skip), the finished epochs' history from the snapshot. The tiny CNN without
batch normalization (``--model tiny-nobn``) on the digits at 8x8, global batch 48 (29 steps an epoch), 2
epochs, ``--trainer fit`` and ``loop``. A global batch that the ranks do not divide is refused before any step,
naming the counts that work. Runs at 1 to 4 ranks (4 -> 3, 3 -> 2, 2 -> 1, 1 -> 1).
Budget: about 40 s at 2 ranks (six runs of two epochs).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from mpi4py import MPI  # noqa: E402

from torus.integrations.keras.app import cli, digits, snapshots, trainer  # noqa: E402

if MPI.COMM_WORLD.Get_size() > 4:
    pytest.skip("the torus-train snapshot tests run at 1 to 4 ranks", allow_module_level=True)
STEPS = 1437 // 48  # the digits' training images in global batches of 48


class Lost(Exception):
    """Stands for the lost rank: raised on every rank before the snapshot of a chosen step is offered."""


@pytest.fixture(scope="module")
def digits8(world):
    folder = Path(world.bcast(tempfile.mkdtemp(prefix="torus-train-snap-") if world.rank == 0 else None))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORUS_CACHE", str(folder / "cache"))
        root = digits.ensure_digits(8) if world.rank == 0 else None
    yield Path(world.bcast(str(root) if root else None))
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def job(world, monkeypatch):
    folder = world.bcast(tempfile.mkdtemp(prefix="torus-train-job-") if world.rank == 0 else None)
    monkeypatch.setenv("TORUS_SNAPSHOT_DIR", folder)
    monkeypatch.setenv("TORUS_JOB_ID", "train-job")
    monkeypatch.setenv("TORUS_SNAPSHOT_SECONDS", "0")
    yield folder
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _trainer(comm, data: Path, how: str, every: int, batch: int = 48):
    args = cli.parse_args(["--data", str(data), "--model", "tiny-nobn", "--image-size", "8", "--epochs", "2",
                           "--batch-schedule", f"0:{batch}", "--warmup-epochs", "0.5", "--verbose", "0",
                           "--trainer", how, "--snapshot-every", str(every), "--augment", "flip"])
    keras.utils.set_random_seed(args.seed)  # as torus-train's main does: every run starts from the same weights
    return trainer.Trainer(args, comm, threads=1)


def _weights(t) -> list:
    return [np.array(v.numpy()) for v in t.model.trainable_variables]


_references: dict = {}


def _reference(world, data, how, monkeypatch) -> tuple[list, dict]:
    """The run that lost nothing, at the full rank count, without snapshots (once per trainer)."""
    if how not in _references:
        with monkeypatch.context() as patch:
            patch.delenv("TORUS_JOB_ID")
            t = _trainer(world, data, how, 4)
            summary = t.run()
        _references[how] = _weights(t), summary
    return _references[how]


# snapshots after steps 1 + k * every (the cadence counts from the first step); the epoch ends at step 29
@pytest.mark.parametrize("how, every, stop", [
    ("fit", 4, 36),   # newest: step 33, epoch 2 batch 4
    ("fit", 4, 32),   # newest: step 29, the epoch's end (epoch 2 at batch 0)
    ("loop", 5, 28),  # newest: step 26, epoch 1 with 3 batches left
])
def test_resume_on_fewer_ranks_equals_the_run_that_lost_nothing(world, digits8, job, monkeypatch, capfd, how,
                                                                 every, stop):
    reference, ref_summary = _reference(world, digits8, how, monkeypatch)
    offer = snapshots.Taker.after_step

    def after_step(self, epoch, done, steps, history):
        if int(self.trainer.model.optimizer.iterations.numpy()) == stop:
            raise Lost
        offer(self, epoch, done, steps, history)
    with monkeypatch.context() as patch:
        patch.setattr(snapshots.Taker, "after_step", after_step)
        lost = _trainer(world, digits8, how, every)
        with pytest.raises(Lost):
            lost.run()
    for store in lost.strategy.snapshots._stores.values():
        store.wait()
    world.Barrier()
    newest = max(s for s in range(1, stop, every))
    keep = world.rank < max(world.size - 1, 1)
    comm = world.Split(0 if keep else MPI.UNDEFINED, world.rank)
    if keep:
        capfd.readouterr()
        again = _trainer(comm, digits8, how, every)
        summary = again.run()
        for store in again.strategy.snapshots._stores.values():  # before the fixture removes the folder
            store.wait()
        err = capfd.readouterr().err
        if comm.rank == 0:
            assert f"torus-run: resumed at step {newest} " in err, err
        assert int(again.model.optimizer.iterations.numpy()) == 2 * STEPS
        for got, want in zip(_weights(again), reference):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        history, ref_history = summary["history"], ref_summary["history"]
        assert [h["epoch"] for h in history] == [1, 2]
        # the done line says which epochs this launch ran (the snapshot's epoch, 1-based, on)
        assert ref_summary["resumed_epoch"] is None and summary["resumed_epoch"] == newest // STEPS + 1
        assert f"in {summary['time_s']:.0f} s (this launch, from epoch {newest // STEPS + 1};" in \
            trainer.summary_line(summary)
        for done in range(newest // STEPS):  # the epochs the snapshot had finished: their records from its meta
            assert history[done]["loss"] == pytest.approx(ref_history[done]["loss"], rel=1e-4)
        assert history[1]["val_top1"] == pytest.approx(ref_history[1]["val_top1"], abs=2 / 360)
        comm.Free()
    world.Barrier()


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (3, 4), reason="50 divides into 1 and 2 ranks")
def test_a_global_batch_the_ranks_do_not_divide_is_refused(world, digits8):
    t = _trainer(world, digits8, "fit", 4, batch=50)
    with pytest.raises(ValueError, match=r"global batch 50 of epoch 1 does not divide into \d ranks; it does into "
                                         r"1, 2, 5"):
        t.run()
