#!/usr/bin/env python
"""Run one of torus' commands (``torus-bench``, ``torus-sim``) from another checkout, ``OLD_TREE``, for rounds
that alternate it with this tree's: the editable install maps ``torus`` to this tree, so the other checkout
goes first on ``sys.path`` (its built extensions copied in: ``cp torus/_ext/*.so $OLD_TREE/torus/_ext/``).

    OLD_TREE=/tmp/wt-old python bench/harness/tree.py torus-sim --ranks 1088 --algo swing
"""
from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

here = os.path.dirname(os.path.abspath(__file__))
ours = {os.path.dirname(os.path.dirname(here)), here}
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in ours]
sys.path.insert(0, os.environ["OLD_TREE"])
command = sys.argv.pop(1)
sys.argv[0] = command
sys.exit(entry_points(group="console_scripts")[command].load()())
