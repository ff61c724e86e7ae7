"""The ``TORUS_*`` knobs: one table (torus/knobs.py), read only through it, listed in the docs from it.

Rule checked over every .py file under torus/ and integrations/ but torus/knobs.py: no string constant that is
a whole ``TORUS_NAME`` appears in code except as the first argument of ``knobs.read`` / ``is_set`` /
``override`` (docstrings and comments may name them), and every name so used is in the table. So
``os.environ.get("TORUS_X")`` fails, and so does ``ENV = "TORUS_X"; os.environ[ENV]``. A prefix alone
(``"TORUS_"``, torus-bench recording every such variable) is not a knob.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from torus import knobs

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"TORUS_[A-Z0-9_]*[A-Z0-9]$")
CODE = [p for d in ("torus", "integrations") for p in sorted((ROOT / d).rglob("*.py"))
        if p != ROOT / "torus" / "knobs.py" and "integrations" not in p.relative_to(ROOT / d).parts[:1]]
# test-harness variables, read under tests/ and bench/ only, documented in docs/clusters.md
HARNESS = {"TORUS_TESTS_RERUN_CRASHED", "TORUS_LARGE_COUNT", "TORUS_CLUSTER", "TORUS_CLUSTER_LAYOUT",
           "TORUS_ENDS_IT", "TORUS_OMPI_VENV", "TORUS_CLUSTER_BURST_S"}


def _uses(path: Path):
    """(line, name, through knobs) of every whole TORUS_ name in the code of ``path``."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    through = set()
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args
                and n.func.attr in ("read", "is_set", "override", "setting")
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "knobs"):
            through.add(id(n.args[0]))
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings \
                and NAME.match(n.value):
            yield n.lineno, n.value, id(n) in through


def test_code_reads_knobs_only_through_the_table():
    bad, used = [], set()
    for path in CODE:
        for line, name, ok in _uses(path):
            where = f"{path.relative_to(ROOT)}:{line}: {name}"
            if not ok:
                bad.append(where + " (read it with knobs.read)")
            elif name not in knobs.KNOBS:
                bad.append(where + " (not in torus/knobs.py's table)")
            used.add(name)
    assert not bad, "\n".join(bad)
    unread = {n for n, k in knobs.KNOBS.items() if not k.build} - used
    assert not unread, f"knobs nobody reads: {sorted(unread)}"


def test_build_knobs_are_the_ones_setup_py_reads():
    named = set(re.findall(r"TORUS_[A-Z0-9_]+", (ROOT / "setup.py").read_text()))
    assert named == {n for n, k in knobs.KNOBS.items() if k.build}


def test_docs_knobs_md_is_generated_from_the_table():
    assert (ROOT / "docs" / "knobs.md").read_text() == knobs.markdown(), \
        "docs/knobs.md is stale: python -m torus.knobs > docs/knobs.md"


def test_docs_name_only_knobs_and_harness_variables():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for p in pages for m in re.findall(r"TORUS_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    unknown = named - set(knobs.KNOBS) - HARNESS
    assert not unknown, f"README.md / docs/ name variables that are not knobs: {sorted(unknown)}"


def test_read(monkeypatch):
    monkeypatch.delenv("TORUS_TIMEOUT", raising=False)
    assert knobs.read("TORUS_TIMEOUT") == 600.0
    monkeypatch.setenv("TORUS_TIMEOUT", " 3 ")
    assert knobs.read("TORUS_TIMEOUT") == 3.0
    monkeypatch.setenv("TORUS_SEGMENT_BYTES", "1e6")
    assert knobs.read("TORUS_SEGMENT_BYTES") == 1000000
    monkeypatch.setenv("TORUS_CHECK", "OFF")
    assert knobs.read("TORUS_CHECK") is False
    monkeypatch.setenv("TORUS_CHECK", "maybe")
    with pytest.raises(ValueError, match="TORUS_CHECK='maybe'"):
        knobs.read("TORUS_CHECK")
    monkeypatch.setenv("TORUS_GPU_REDUCE", "")
    assert knobs.read("TORUS_GPU_REDUCE") is None and not knobs.is_set("TORUS_GPU_REDUCE")
    with pytest.raises(KeyError):
        knobs.read("TORUS_NO_SUCH_KNOB")
