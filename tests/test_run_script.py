"""tests/run.py's own rules: a crashed suite fails the run unless a rerun is explicitly allowed, its JUnit
folder is removed, and skips are summarised one line per reason."""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("torus_run", Path(__file__).with_name("run.py"))
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def _args(rerun: bool) -> argparse.Namespace:
    return argparse.Namespace(ranks="", timeout=10, skip_single=False, rerun_crashed=rerun, pytest_args=[],
                              no_cluster=True)


def _fake(monkeypatch, codes):
    """Each suite run returns the next exit status of ``codes``."""
    calls = []

    def fake_run(cmd, timeout, env):
        calls.append(cmd)
        return codes[len(calls) - 1]
    monkeypatch.setattr(run, "_run", fake_run)
    return calls


@pytest.mark.parametrize("rerun, codes, status, runs", [
    (False, [-11], 1, 1),         # a crash fails, and is not rerun
    (True, [-11, 0], 0, 2),       # rerun allowed: the passing rerun counts
    (True, [139, 139], 1, 2),     # crashes again: fails
])
def test_crash_rule(monkeypatch, capsys, tmp_path, rerun, codes, status, runs):
    calls = _fake(monkeypatch, codes)
    assert run._all_suites(_args(rerun), tmp_path) == status
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == runs
    assert any(line.startswith("CRASH tests: killed by SIGSEGV") for line in out)
    failed = 1 if status else 0
    assert out[-1] == f"0 passed, {failed} failed, 0 skipped"


def test_default_is_no_rerun(monkeypatch):
    monkeypatch.delenv("TORUS_TESTS_RERUN_CRASHED", raising=False)
    monkeypatch.setattr("sys.argv", ["run.py", "--ranks", "", "--skip-single"])
    folders = []
    real = tempfile.TemporaryDirectory

    def spy(*a, **k):
        folders.append(real(*a, **k))
        return folders[-1]
    monkeypatch.setattr(run.tempfile, "TemporaryDirectory", spy)
    monkeypatch.setattr(run, "_all_suites", lambda args, tmp: int(args.rerun_crashed) + 7)
    assert run.main() == 7
    assert folders and not Path(folders[0].name).exists()


def test_skip_lines_group_by_reason():
    reasons = ["a 2x3 grid does not fit 4 ranks"] * 3 + ["a 1x5 grid does not fit 4 ranks"] + ["needs a GPU"] * 2
    assert run.skip_lines(reasons) == ["skipped 4: a 2x3 grid does not fit 4 ranks (and 1 similar)",
                                       "skipped 2: needs a GPU"]
