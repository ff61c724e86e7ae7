"""Every ``torus.`` dotted name and every repository path that the docs name exists, so a rename that forgets
a docstring or a page fails here.

Scanned: the docstrings and comments of the Python files under torus/ and integrations/, README.md, docs/*.md,
bench/README.md and each experiment's bench/*/README.md, and the pages under integrations/ (FEATURES.md, HOROVOD.md). A
dotted name ``torus.a.b.c`` must import as far as it is a module and resolve by getattr after that (a class attribute,
method or property; not an attribute set on instances). A path starting with one of the repository's folders
(``torus/``, ``src/``, ``integrations/``, ``tests/``, ``bench/``, ``docs/``) must exist; ``*`` and ``{a,b}`` in it are
expanded as a shell would, and one match is enough. Modules that need TensorFlow are imported too, so this test needs
the ``[tf]`` extra.
"""
from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOTTED = re.compile(r"(?<![\w./-])torus(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./~-])(?:torus|src|integrations|tests|bench|docs)/[\w.*{},/$-]*[\w*}]")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
         *sorted((ROOT / "bench").glob("*/README.md")),
         *sorted((ROOT / "integrations").rglob("*.md"))]
SOURCES = [p for d in ("torus", "integrations") for p in sorted((ROOT / d).rglob("*.py"))
           if not (d == "torus" and "integrations" in p.relative_to(ROOT / d).parts[:1])]


def _texts():
    """(where, text) of every page and every docstring and comment."""
    for page in PAGES:
        yield str(page.relative_to(ROOT)), page.read_text()
    for path in SOURCES:
        src = path.read_text()
        rel = str(path.relative_to(ROOT))
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                yield f"{rel}:{tok.start[0]}", tok.string
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{rel}:{node.body[0].lineno}", doc


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            i -= 1
    if obj is None:
        return False
    for name in parts[i:]:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    """``$var`` (a shell loop's variable) matches anything; in an experiment's results/ folder a path may be an
    output stem (``--out bench/shared_memory/results/native_peers`` writes ``native_peers.txt`` and ``.json``) or
    a file that a command there writes: the folder is enough (tests/test_bench_index.py checks bench/ closely)."""
    path = re.sub(r"\*+", "*", re.sub(r"\$\w+", "*", path.rstrip(".,")))
    results = re.match(r"bench/[\w-]+/results/", path)
    if results and (ROOT / results.group(0)).is_dir():
        return True
    return any((ROOT / p).exists() or any(ROOT.glob(p)) for p in _expand(path))


def _found():
    names, paths = {}, {}
    for where, text in _texts():
        for name in DOTTED.findall(text):
            names.setdefault(name.rstrip("."), where)
        for path in PATH.findall(text):
            paths.setdefault(path, where)
    return names, paths


NAMES, PATHS = _found()


def test_dotted_names_exist():
    pytest.importorskip("tensorflow")
    bad = [f"{where}: {name}" for name, where in sorted(NAMES.items()) if not _resolves(name)]
    assert not bad, "names that do not exist:\n" + "\n".join(bad)



def test_paths_exist():
    bad = [f"{where}: {path}" for path, where in sorted(PATHS.items())
           if not _exists(path)]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def test_the_checks_see_a_stale_name():
    assert _resolves("torus.runtime.shm.SharedMemory") and not _resolves("torus.runtime.staged")
    assert _exists("bench/torus_bench/results/allreduce_float32_p{2,4}.txt") and not _exists("torus/runtime/staged.py")
    assert not _exists("bench/results/allreduce_float32_p2.txt")


# Module docstrings say what the module is for and its contract; the rest belongs in docs/.
MAX_DOC_LINES = 32


def test_module_docstrings_are_short():
    long = []
    for path in SOURCES:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        rel = str(path.relative_to(ROOT))
        if doc.count("\n") + 1 > MAX_DOC_LINES:
            long.append(f"{rel}: {doc.count(chr(10)) + 1} lines")
    assert not long, f"module docstrings over {MAX_DOC_LINES} lines (move the rest to docs/):\n" + "\n".join(long)
