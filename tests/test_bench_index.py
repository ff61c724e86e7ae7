"""bench/ stays an index of experiment folders, and what cites it stays valid.

- bench/ holds README.md (the index, at most 200 lines) and folders only; every folder (outside a ``results/``
  folder) has a README.md and is named in the index.
- Every ``bench/...`` path that a tracked-or-new file of the repository names (``*.py``, ``*.pyx``, ``*.pxd``,
  ``*.h``, ``*.md``, ``*.sh``, ``*.toml``, ``*.cfg``, ``.ci/run``; the run records under ``results/`` aside)
  exists. ``*`` and ``{a,b}`` expand as a shell would and one match is enough; ``$var`` matches anything; a
  path inside a ``results/`` folder may be an output stem (``--out .../native_peers`` writes
  ``native_peers.txt``), and one that a command writes (after ``--out``, ``--json``, ``>`` ...) needs only its
  ``results/`` folder. Python's ``ROOT / "bench" / "x" / ...`` chains are checked too.
- A citation of a README's section (``bench/overlap/README.md, "The bucket ramp"``) names a heading or a bold
  lead-in (``**The bucket ramp**``) of that README; so do the index's rows (``(overlap/README.md), "..."``).
- Inside bench/'s READMEs, relative paths (``results/...``, ``../folder/...``) exist from the README's folder.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
INDEX = BENCH / "README.md"
MAX_INDEX_LINES = 200
SUFFIXES = {".py", ".pyx", ".pxd", ".h", ".md", ".sh", ".toml", ".cfg"}
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules",
             "results"}
PATH = re.compile(r"(?<![\w./~-])bench/[\w.*{},/$-]*[\w*}]")
CHAIN = re.compile(r"""["']bench["']((?:\s*/\s*["'][^"'/]+["'])+)""")
SECTION = re.compile(r"""(?<![\w./~-])((?:bench/)?(?:[\w-]+/)?README\.md)\)?\s*[,(]\s*(?:section\s+)?"([^"]+)\"""")
# what comes before a file that a command writes: an output option, a redirection, a default output path
OUTPUT = re.compile(r"""(?:--(?:out|json|jsonl|txt|csv|plot)[ =]|>>?\s*|\btee (?:-a )?|Path\(["']|default=["']?)$""")
RELATIVE = re.compile(r"(?<![\w./~-])(?:results|\.\./[\w-]+)/[\w.*{},/$-]*[\w*}]")
# files whose stale paths are deliberate: the checks' own examples
EXAMPLES = {Path(__file__).resolve(), ROOT / "tests" / "test_doc_names.py"}


def _files():
    """Every source and documentation file of the working tree but the virtual environments and run records."""
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")
                         and not d.endswith(".egg-info") and not os.path.islink(os.path.join(top, d)))
        for name in sorted(names):
            path = Path(top, name)
            if path.suffix in SUFFIXES and path not in EXAMPLES:
                yield path
    yield ROOT / ".ci" / "run"


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str, base: Path = ROOT, output: bool = False) -> bool:
    path = re.sub(r"\*+", "*", re.sub(r"\$\w+", "*", path.rstrip(".,")))
    for p in _expand(path):
        if output and "results/" in p and (base / p.rsplit("results/", 1)[0] / "results").is_dir():
            return True
        if (base / p).exists() or any(base.glob(p)):
            return True
        if "results/" in p and not p.endswith("/"):  # an output stem, or a run's suffixed files
            stem = p.rsplit(".", 1)[0] if "." in p.rsplit("/", 1)[-1] else p
            if any(base.glob(p + "*")) or any(base.glob(stem + "*")):
                return True
    return False


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_bench_holds_the_index_and_folders_only():
    loose = [p.name for p in BENCH.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"files directly in bench/ (each belongs in an experiment's folder): {sorted(loose)}"


def test_the_index_is_short():
    lines = INDEX.read_text().count("\n")
    assert lines <= MAX_INDEX_LINES, f"bench/README.md has {lines} lines: at most {MAX_INDEX_LINES} (notes go in the "\
                                     "experiment's README)"


def test_every_folder_has_a_readme_and_a_line_in_the_index():
    index = INDEX.read_text()
    bad = []
    for top, dirs, _ in os.walk(BENCH):
        dirs[:] = [d for d in dirs if d not in ("results", "__pycache__") and not d.startswith(".")]
        for d in dirs:
            folder = Path(top, d)
            if not (folder / "README.md").exists():
                bad.append(f"{_rel(folder)}/ has no README.md")
            if folder.parent == BENCH and f"{d}/" not in index:
                bad.append(f"{_rel(folder)}/ has no line in bench/README.md")
    assert not bad, "\n".join(bad)


def _cited():
    """(file, path, whether a command writes it) of every bench/ path the repository names."""
    for path in _files():
        text = path.read_text(errors="replace")
        for m in PATH.finditer(text):
            before = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
            yield _rel(path), m.group(0), bool(OUTPUT.search(before))
        if path.suffix == ".py":
            for m in CHAIN.finditer(text):
                yield _rel(path), "/".join(["bench", *re.findall(r"""["']([^"']+)["']""", m.group(1))]), False


def test_cited_bench_paths_exist():
    bad = sorted({f"{where}: {p}" for where, p, output in _cited()
                  if not _exists(p, output=output)})
    assert not bad, "bench/ paths that do not exist (moved? see bench/README.md):\n" + "\n".join(bad)


def _heads(readme: Path) -> list[str]:
    """Its headings and bold lead-ins, lower case, whitespace folded."""
    text = readme.read_text()
    found = re.findall(r"^#+\s+(.*)$", text, re.M) + re.findall(r"\*\*(.+?)\*\*", text, re.S)
    return [" ".join(h.split()).lower() for h in found]


def test_cited_sections_exist():
    bad = []
    for path in _files():
        text = re.sub(r"\s*\n\s*(?:#+|//|\*)?\s*", " ", path.read_text(errors="replace"))  # lines joined
        for readme, section in SECTION.findall(text):
            base = INDEX.parent if path == INDEX else ROOT
            target = (base / readme) if (base / readme).exists() else None
            if target is None or not readme.startswith("bench/") and path != INDEX:
                continue  # another README (or not bench's): not this test's
            want = " ".join(section.split()).lower().split("...")[0].strip(" ,")
            if not any(want in h for h in _heads(target)):
                bad.append(f"{_rel(path)}: {readme}, \"{section}\"")
    assert not bad, "sections cited that the README does not have:\n" + "\n".join(sorted(set(bad)))


def test_relative_paths_in_bench_readmes_exist():
    bad = []
    for readme in sorted(BENCH.glob("*/README.md")) + [INDEX]:
        for m in RELATIVE.finditer(readme.read_text()):
            if not _exists(m.group(0), readme.parent):
                bad.append(f"{_rel(readme)}: {m.group(0)}")
    assert not bad, "relative paths in bench/'s READMEs that do not exist:\n" + "\n".join(bad)


def test_the_checks_see_a_stale_path(tmp_path):
    assert _exists("bench/torus_bench/results/allreduce_float32_p{2,4}.txt")
    assert _exists("bench/shared_memory/results/native_peers")  # an output stem
    assert not _exists("bench/results/allreduce_float32_p2.txt") and not _exists("bench/overlap.py")
    assert _exists("bench/overlap/results/next.jsonl", output=True)  # a file a command writes
    assert not _exists("bench/overlap/results/next.jsonl") and not _exists("bench/results/x.json", output=True)
    assert OUTPUT.search("mpiexec -n 2 python x.py --json ") and not OUTPUT.search("see ")
    stale = 'x = ROOT / "bench" / "results" / "overlap.jsonl"  # bench/overlap/README.md, "No such part"'
    assert CHAIN.search(stale) and SECTION.search(stale)
    assert "no such part" not in " ".join(_heads(BENCH / "overlap" / "README.md"))
