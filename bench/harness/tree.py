#!/usr/bin/env python
"""Run one command from another source tree: a console script (``torus-bench``, ``torus-sim``, ``torus-train``, ...)
or a ``.py`` file, with TREE first on ``sys.path`` and this checkout off it. The editable install maps ``torus`` to
this checkout, so without this the other tree's code would not run. TREE's extensions must be built in place
(``python setup.py build_ext --inplace`` there) or copied in (``cp torus/_ext/*.so TREE/torus/_ext/``).
``PYTHONPATH`` starts with TREE too, for the processes the command starts.

    python bench/harness/tree.py /tmp/wt-old torus-sim --ranks 1088 --algo swing
    mpiexec -n 2 python bench/harness/tree.py /tmp/wt-old bench/overlap/one_host_step.py --model mlp

bench/harness/ab.py runs each source-tree side of an A/B through this.
"""
from __future__ import annotations

import os
import runpy
import sys
from importlib.metadata import entry_points


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) > 1 else 2
    tree, command = os.path.abspath(sys.argv[1]), sys.argv[2]
    here = os.path.dirname(os.path.abspath(__file__))
    ours = {os.path.dirname(os.path.dirname(here)), here}  # this checkout's root and this folder
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in ours]
    sys.path.insert(0, tree)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    sys.argv = [command, *sys.argv[3:]]
    if command.endswith(".py"):
        sys.path.insert(1, os.path.dirname(os.path.abspath(command)))  # where ``python FILE`` would look next
        runpy.run_path(command, run_name="__main__")
        return 0
    found = entry_points(group="console_scripts", name=command)
    if not found:
        raise SystemExit(f"{command}: neither a .py file nor a console script")
    result = next(iter(found)).load()()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
