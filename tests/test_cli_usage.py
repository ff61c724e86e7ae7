"""Bad command lines under ``mpiexec -n 2``: one line on stderr from rank 0, exit status 2, nothing on stdout,
and for torus-train before TensorFlow is imported (a ``tensorflow`` that raises on import sits first on the
path, so reaching the import would end differently). Each case is a fresh 2-rank job of about a second.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")


@pytest.fixture(scope="module")
def no_tensorflow(tmp_path_factory) -> Path:
    """A folder holding a ``tensorflow`` package whose import fails loudly."""
    root = tmp_path_factory.mktemp("fake-tf")
    (root / "tensorflow").mkdir()
    (root / "tensorflow" / "__init__.py").write_text("raise ImportError('tensorflow imported before validation')\n")
    return root


def _job(module: str, *args: str, ranks: int = 2, pythonpath: Path | None = None, **env_vars: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL"))}
    env.update(env_vars)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


TRAIN = "torus.integrations.keras.app.cli"


@pytest.mark.parametrize("args, expected", [
    (["--dims", "3x3"], "--dims 3x3: 3x3 = 9 ranks, but this job has 2"),
    (["--dims", "banana"], "--dims 'banana': expected XxY"),
    (["--batch-schedule", "0:63"], "global batch 63 does not divide into 2 ranks"),
    (["--batch-schedule", "0:64,3:99", "--epochs", "4"], "global batch 99 does not divide into 2 ranks"),
    (["--batch-schedule", "5:64"], "needs an entry for epoch 0"),
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
    (["--image-size", "16"], "ResNet-50 needs at least 32 pixels"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--summary", "/no/such/dir/s.json"], "folder /no/such/dir does not exist"),
    (["--data", "/no/such/folder"], "--data /no/such/folder: no such folder"),
    (["--epochs", "1", "--warmup-epochs", "1"], "--warmup-epochs 1 must be below --epochs 1"),
])
def test_train_usage_error_is_one_line_before_tensorflow(no_tensorflow, args, expected):
    proc = _job(TRAIN, *args, pythonpath=no_tensorflow)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torus-train: error: ") and expected in lines[0], proc.stderr


def test_train_missing_fashion_mnist_is_one_line_before_tensorflow(no_tensorflow, tmp_path):
    """A folder with some of the four idx files, and (where the package is absent) ``--data fashion-mnist``:
    one line that says how to get the data, exit status 2."""
    from torus.integrations.keras.app.idx import FASHION_MNIST_DIR
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"")
    cases = [(str(tmp_path), f"--data {tmp_path} lacks train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz]; "
                             "apt-get install dataset-fashion-mnist, or --data DIR holding ")]
    if not FASHION_MNIST_DIR.is_dir():
        cases.append(("fashion-mnist", f"--data fashion-mnist: {FASHION_MNIST_DIR} does not exist; apt-get install "
                                       "dataset-fashion-mnist, or --data DIR holding "))
    for data, expected in cases:
        proc = _job(TRAIN, "--data", data, "--model", "resnet20", pythonpath=no_tensorflow)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"torus-train: error: {expected}"), proc.stderr


def test_train_image_size_default_follows_the_data(tmp_path):
    from torus.integrations.keras.app.cli import parse_args
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(b"")
    assert parse_args(["--data", str(tmp_path), "--model", "resnet20"]).image_size == 28
    assert parse_args(["--data", str(tmp_path)]).image_size == 32  # ResNet-50 needs 32
    assert parse_args(["--model", "resnet20"]).image_size == 32  # the digits
    assert parse_args(["--data", str(tmp_path), "--model", "tiny", "--image-size", "20"]).image_size == 20


def test_train_default_warmup_fits_a_short_run():
    from torus.integrations.keras.app.cli import DEFAULTS, parse_args
    assert parse_args([]).warmup_epochs == DEFAULTS["warmup_epochs"]
    assert parse_args(["--epochs", "1"]).warmup_epochs == 0.5  # half of the run: the default would refuse it
    assert parse_args(["--epochs", "1", "--warmup-epochs", "0.25"]).warmup_epochs == 0.25


def test_train_help_prints_once(no_tensorflow):
    proc = _job(TRAIN, "--help", pythonpath=no_tensorflow)
    assert proc.returncode == 0 and proc.stdout.count("usage: torus-train") == 1, proc.stdout + proc.stderr
    options = re.split(r"\n  (?=-)", proc.stdout)
    assert all(option.count("default") <= 1 for option in options), proc.stdout  # each default said once
    assert "--batch-schedule" in proc.stdout and "``" not in proc.stdout


@pytest.mark.parametrize("args, expected", [
    (["allreduce", "--dims", "3x1"], "--dims 3x1: 3 ranks, but this job has 2"),
    (["allreduce", "--plot", "/no/such/dir/x.png"], "--plot /no/such/dir/x.png: folder /no/such/dir does not exist"),
    (["allreduce", "--algo", "ring,banana"], "unknown algorithm(s) banana"),
    (["allreduce", "-e", "64Q"], "size '64Q'"),
    (["allreduce", "-d", "int32", "-o", "avg"], "-o avg is not defined for int32"),
    (["allgather", "--alloc"], "--alloc is for allreduce"),
])
def test_bench_usage_error_is_one_line(args, expected):
    proc = _job("torus.bench.cli", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torus-bench: error: ") and expected in lines[0], proc.stderr


@pytest.mark.parametrize("args", [["--algo", "ring,shm"], ["--alloc"]])
def test_bench_shared_memory_across_nodes_is_a_usage_error(args):
    """Two emulated nodes of one rank: shm and alloc buffers are refused in one line before the sweep, and the
    default algorithm list leaves shm out instead of failing mid-sweep."""
    proc = _job("torus.bench.cli", "allreduce", *args, TORUS_RANKS_PER_NODE="1")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "needs every rank on one node; these 2 ranks are on 2 nodes" in lines[0], lines
    proc = _job("torus.bench.cli", "allreduce", "-e", "64", "-n", "1", "-w", "0", TORUS_RANKS_PER_NODE="1")
    assert proc.returncode == 0, proc.stderr
    algos = {line.split()[4] for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert "shm" not in algos and {"ring", "native"} <= algos, proc.stdout


def test_bench_help_shows_sizes_in_units():
    proc = _job("torus.bench.cli", "--help")
    assert proc.returncode == 0 and proc.stdout.count("usage: torus-bench") == 1
    assert "(default: 64M)" in proc.stdout and "67108864" not in proc.stdout and "['" not in proc.stdout


def test_sim_usage_errors(tmp_path):
    from torus.sim.cli import main
    assert main(["--ranks", "6", "--dims", "4x2"]) == 2
    assert main(["--sweep", "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    assert main(["--params", str(tmp_path / "none.json")]) == 2


@pytest.mark.parametrize("module", ["torus.integrations.keras.app.cli", "torus.bench.cli", "torus.sim.cli"])
def test_every_flag_has_help(module):
    import importlib
    parser = importlib.import_module(module).parser()
    assert [a.dest for a in parser._actions if not a.help] == []


def test_failure_on_one_rank_is_one_line_and_ends_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier it will never complete: one line, then MPI_Abort."""
    script = tmp_path / "fails.py"
    script.write_text("from mpi4py import MPI\nfrom torus import cli\ncomm = MPI.COMM_WORLD\n"
                      "cli.abort_on_error(comm, 'demo')\nif comm.Get_rank() == 1:\n"
                      "    raise ValueError('bad shard\\n  on two lines')\ncomm.Barrier()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL"))}
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("demo:")]
    assert ours == ["demo: rank 1 failed: ValueError: bad shard on two lines (--debug shows the traceback)"], \
        proc.stderr
    assert "Traceback" not in proc.stderr
