"""Runs every code block in README.md and docs/*.md that is marked runnable, and compares its output with the
output the page shows.

Markers are HTML comments on the line right before a fence (Markdown renderers hide them):

- ``<!-- run -->``: run the block (```python: with this Python; ```bash: with bash, this Python's ``bin/`` first
  on PATH); ``<!-- run: mpiexec -n N -->``: a python block under ``mpiexec -n N``.
- ``<!-- output -->`` before the next fence: the output that block must print. It may come after a line of
  prose. A python block is compared on stdout (TensorFlow logs on stderr); a bash block on stdout and stderr
  together, as a terminal shows them.

Comparison, after dropping trailing blank lines: the same number of lines, and each line equal once runs of
blanks are made one, except that numbers may differ by a relative 1e-4 (or 1e-6 absolute), for float sums
that a new library version rounds in the last digits. A block must exit 0 unless it shows its exit status.
Each block runs in a fresh temporary folder (files it writes go there) and under a time limit.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import jobs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT_S = 180
MARK = re.compile(r"^<!--\s*(run(?::\s*mpiexec -n (\d+))?|output)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass
class Example:
    page: str
    line: int  # of the fence, 1-based
    lang: str
    code: str
    ranks: int  # 0: not under mpiexec
    output: str | None


def parse(text: str, page: str = "page") -> list[Example]:
    """The marked blocks of one Markdown page, each with the output block that follows it, if any."""
    lines = text.split("\n")
    examples: list[Example] = []
    i = 0
    pending = None  # the mark of the next fence: ("run", ranks) or ("output", 0)
    while i < len(lines):
        m = MARK.match(lines[i])
        fence = FENCE.match(lines[i])
        if m:
            pending = ("output", 0) if m.group(1) == "output" else ("run", int(m.group(2) or 0))
        elif fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 1:end]) + "\n"
            if pending and pending[0] == "run":
                if fence.group(1) not in ("python", "bash"):
                    raise ValueError(f"{page}:{i + 1}: a runnable block must be python or bash")
                examples.append(Example(page, i + 1, fence.group(1), body, pending[1], None))
            elif pending and pending[0] == "output":
                if not examples or examples[-1].output is not None:
                    raise ValueError(f"{page}:{i + 1}: an output block with no runnable block before it")
                examples[-1].output = body
            pending = None
            i = end
        i += 1
    return examples


def _close(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    return math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6)


def differences(shown: str, printed: str) -> list[str]:
    """Where ``printed`` does not match ``shown`` (empty: they match), one entry per line."""
    want = [" ".join(line.split()) for line in shown.rstrip("\n").split("\n")]
    got = [" ".join(line.split()) for line in printed.rstrip("\n").split("\n")]
    if len(want) != len(got):
        return [f"{len(got)} lines printed, {len(want)} shown:\n" + "\n".join(got)]
    out = []
    for n, (w, g) in enumerate(zip(want, got), 1):
        if NUMBER.sub("#", w) != NUMBER.sub("#", g) or not all(
                _close(a, b) for a, b in zip(NUMBER.findall(w), NUMBER.findall(g))):
            out.append(f"line {n}: shown {w!r}, printed {g!r}")
    return out


def run(example: Example, folder: Path) -> tuple[int, str]:
    """Run one block in ``folder``: (exit status, what is compared)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
    if example.lang == "bash":
        cmd, stderr = ["bash", "-c", example.code], subprocess.STDOUT
    else:
        script = folder / "example.py"
        script.write_text(example.code)
        cmd, stderr = [sys.executable, str(script)], subprocess.PIPE
        if example.ranks:
            cmd = [jobs.mpiexec(), "-n", str(example.ranks), *cmd]
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)
    out, err = jobs.finish(proc, LIMIT_S, f"{example.page}:{example.line}")
    if proc.returncode and example.lang == "python":
        pytest.fail(f"{example.page}:{example.line} exited {proc.returncode}:\n{out[-2000:]}\n{(err or '')[-3000:]}")
    return proc.returncode, out


EXAMPLES = [e for page in PAGES for e in parse(page.read_text(), str(page.relative_to(ROOT)))]


def test_pages_have_examples():
    assert any(e.page == "README.md" for e in EXAMPLES), "README.md lost its runnable examples"


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.page}:{e.line}" for e in EXAMPLES])
def test_example(example, tmp_path):
    status, out = run(example, tmp_path)
    if example.output is None:
        assert status == 0, f"{example.page}:{example.line} exited {status}:\n{out[-2000:]}"
        return
    bad = differences(example.output, out)
    assert not bad, f"{example.page}:{example.line}: the output differs from the page:\n" + "\n".join(bad)


# The checker itself: a changed figure, a renamed flag, a lost line each fail.

PAGE = """text
<!-- run -->
```bash
echo "loss 0.0468 accuracy 0.9906"; echo done
```

prose between
<!-- output -->
```
loss 0.0468 accuracy 0.9906
done
```
"""


def test_parse_pairs_blocks_with_output():
    (e,) = parse(PAGE)
    assert (e.lang, e.ranks, e.line) == ("bash", 0, 3) and e.output == "loss 0.0468 accuracy 0.9906\ndone\n"
    (m,) = parse("<!-- run: mpiexec -n 3 -->\n```python\nprint(1)\n```\n")
    assert m.ranks == 3 and m.output is None


def test_differences():
    shown = "loss 0.0468 accuracy 0.9906\ndone\n"
    assert differences(shown, "loss  0.04680001 accuracy 0.9906\ndone\n\n") == []
    assert differences(shown, "loss 0.0470 accuracy 0.9906\ndone\n")  # a changed figure
    assert differences(shown, "loss 0.0468 acc 0.9906\ndone\n")  # a renamed word
    assert differences(shown, "loss 0.0468 accuracy 0.9906\n")  # a lost line


def test_a_broken_example_fails(tmp_path):
    (e,) = parse(PAGE.replace('echo done', 'torus-sim --no-such-flag'))
    status, out = run(e, tmp_path)
    assert status != 0 and differences(e.output, out)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines: at most 150 (the rest belongs in docs/)"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.split("\n") if line.endswith("tests/run.py"))
    assert command in (ROOT / ".ci" / "run").read_text().split("\n"), \
        f".ci/run must run README.md's test command verbatim: {command}"
