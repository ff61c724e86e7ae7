"""No measured figure in the comments and docstrings of torus/, src/ and integrations/: measurements live in
bench/'s experiment folders (their results/ and READMEs) and docs/, which the code cites (NCCL's header holds
contracts, never timings).

The rule. A measured figure is what a run reported about speed:
- a rate: a number with a unit per second (``2.4 Gbit/s``, ``0.37 GB/s``, ``13 GiB/s``);
- a ratio: a number with ``x`` (``0.9x``, ``2x faster``) or ``%`` (``10-20% faster``);
- a duration on a line that says it was observed: a number with ``ns``, ``us``, ``µs``, ``ms``, ``s`` or
  ``min`` (or the words) and a word like took, measured, faster, slower, spent, costs, ran, median, against.
Not figures: settings and limits the code chooses (``default 600 s``, ``after 5 s``, ``up to 16 KiB``), sizes
alone (``64 MiB``), grids (``2x2``), and a unit without a number (``Gbit/s``). The few lines that match the
rule but are not measurements are in ALLOWED, each with its reason.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATE = re.compile(r"\d[\d.,]*\s*(?:[kKMGT]i?)?(?:B|bit|b)/s\b")
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)|\d+(?:\.\d+)?\s*%")
DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:ns|us|µs|ms|s|min|(?:micro|milli)?seconds|minutes)\b")
OBSERVED = re.compile(r"\b(took|takes?|measured|faster|slower|spent|spends|costs?|ran|median|against)\b",
                      re.I)
# (file, text on the line, why it is not a measurement)
ALLOWED = [
    ("integrations/keras/app/digits.py", "(80 %, stratified", "the train/validation split, a setting"),
    ("integrations/keras/app/digits.py", "(20 %)", "the train/validation split, a setting"),
]


def _python_texts(path: Path):
    src = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            for i, line in enumerate(node.body[0].value.value.split("\n")):
                yield node.body[0].lineno + i, line


def _c_texts(path: Path):
    """Comments of Cython and C files: from ``#`` or ``//`` to the end of the line, block comments and
    (Cython) docstring-looking lines; loose, since a false hit is cheap to allow."""
    for n, line in enumerate(path.read_text().split("\n"), 1):
        m = re.search(r"#|//|/\*|^\s*\*|\"\"\"", line)
        if m:
            yield n, line[m.start():]


def figures(path: Path) -> list[str]:
    rel = str(path.relative_to(ROOT))
    texts = _python_texts(path) if path.suffix == ".py" else _c_texts(path)
    out = []
    for n, text in texts:
        if RATE.search(text) or RATIO.search(text) or (DURATION.search(text) and OBSERVED.search(text)):
            if not any(rel == f and snippet in text for f, snippet, _ in ALLOWED):
                out.append(f"{rel}:{n}: {text.strip()}")
    return out


def _files():
    for top in ("torus", "src", "integrations"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in (".py", ".pyx", ".pxd", ".h") and not (top == "torus" and "integrations" in p.parts):
                yield p


def test_no_measured_figures_in_code():
    found = [hit for p in _files() for hit in figures(p)]
    assert not found, ("measured figures in comments or docstrings (move them to an experiment's folder "
                       "under bench/ or to docs/ and cite the file):\n" + "\n".join(found))


def test_the_rule(tmp_path):
    sample = ROOT / "torus" / "_figures_sample.py"
    try:
        sample.write_text('"""Default 600 s; a 2x2 grid; up to 64 MiB."""\n'
                          "X = 1  # at 2 ranks 256 KiB steps took 0.9x the time\n"
                          "Y = 2  # the link read 2.4 Gbit/s\n"
                          "Z = 3  # 1 MiB in 25 us against 18 us\n")
        assert [h.split(":")[1] for h in figures(sample)] == ["2", "3", "4"]
    finally:
        sample.unlink()
