"""The compatibility layer (integrations/keras/compat.py): every Keras / TensorFlow internal is resolved there and
nowhere else, a missing one fails the import with its name, an untested version warns with the tested range, and
the accessors read the real attributes of the installed Keras."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from packaging.version import Version  # noqa: E402

from torus.integrations.keras import compat  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "integrations" / "keras"
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
OWN_PRIVATE = {"_executor"}  # torus' own (TorusComm's executor)


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "compat.py":
            yield path, ast.parse(path.read_text(), filename=str(path))


def _own_names(tree) -> set[str]:
    """Private names a module defines itself: ``self._x = ...`` / ``obj._x = ...`` targets and methods."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute):
                names.add(target.attr)
    return names


def test_private_names_only_in_compat():
    found = []
    for path, tree in _sources():
        own = _own_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            if isinstance(node, ast.Import):
                found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.startswith(PRIVATE_MODULES)]
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("object.__setattr__", "object.__delattr__"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)} (use compat.set_on_instance)")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                    for t in node.targets):
                found.append(f"{path.name}:{node.lineno} __class__ = ... (use compat.swap_class)")
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith(("__", "_torus")) or name in OWN_PRIVATE:
                continue
            inherited = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") or \
                isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"
            if inherited and (name in own or name in compat.INHERITED):
                continue
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, "private Keras / TensorFlow names outside compat.py:\n" + "\n".join(found)


def test_the_check_itself_finds_a_private_name(tmp_path):
    # The scan above must be able to fail: the same walk over a module that imports keras.src finds it.
    tree = ast.parse("from keras.src.utils import file_utils\nmodel._distribute_strategy = None\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module.startswith(PRIVATE_MODULES) for n in ast.walk(tree))
    assert [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)] == ["_distribute_strategy"]


def test_required_names_exist_on_this_keras():
    compat.check_required()
    for _, names in compat.REQUIRED:
        assert names


def test_a_missing_name_fails_with_its_name(monkeypatch):
    monkeypatch.setattr(compat, "REQUIRED", (("trainer.TensorFlowTrainer", ("fit", "no_such_hook")),))
    with pytest.raises(ImportError, match=r"TensorFlowTrainer\.no_such_hook is missing.*installed keras "
                                          + keras.__version__.replace(".", r"\.")):
        compat.check_required()


def test_tested_range_declared_and_holds_this_install():
    ranges = compat.tested_range()
    if not ranges:
        pytest.skip("torus is not installed (no package metadata)")
    spec = ranges["keras"]
    lower = [s for s in spec if s.operator == ">="]
    upper = [s for s in spec if s.operator in ("<", "<=")]
    assert lower and upper, f"pyproject.toml's keras requirement needs a lower and an upper bound, has {spec}"
    assert spec.contains(Version(keras.__version__)), (keras.__version__, str(spec))
    assert compat.check_versions(lambda line: None) == []


def test_an_untested_version_warns_once_with_the_range(monkeypatch):
    if not compat.tested_range():
        pytest.skip("torus is not installed (no package metadata)")
    monkeypatch.setattr(compat, "installed", lambda: {"keras": "3.99.0", "tensorflow-cpu": tf.__version__})
    lines = []
    assert compat.check_versions(lines.append) == lines
    assert len(lines) == 1 and "keras 3.99.0 is outside the tested range keras" in lines[0]
    assert str(compat.tested_range()["keras"]) in lines[0]


def test_accessors_read_the_real_attributes(tmp_path):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        inside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
        optimizer = keras.optimizers.SGD(0.1)
    outside_optimizer = keras.optimizers.Adam()
    assert compat.model_strategy(inside) is strategy
    assert strategy.extended._device  # an INHERITED instance attribute, read by strategy.py
    assert compat.optimizer_strategy(optimizer) is strategy
    assert compat.optimizer_strategy(outside_optimizer) is compat.default_strategy()
    assert "d" in [layer.name for layer in compat.flatten_layers(inside)]
    optimizer.build(inside.trainable_variables)
    assert int(optimizer._iterations.numpy()) == 0  # an INHERITED instance attribute, read by horovod/
    assert len(optimizer._trainable_variables) == len(inside.trainable_variables)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "b"))
    assert all(str(tmp_path / "b") in p for p in compat.backup_files(backup))
    assert set(compat.backup_position(backup)) == {"epoch", "batch"}
    compat.set_initial_epoch(inside, 4)
    assert compat.initial_epoch(inside) == 4
    ds = tf.data.Dataset.range(10)
    assert compat.shard_count(ds.shard(3, 1)) == 3 and compat.shard_count(ds) is None
    mapped = ds.map(lambda v: v + 1)
    assert compat.dataset_inputs(mapped) == [ds] and compat.dataset_inputs(ds) == []
    with pytest.raises(TypeError, match="not a subclass"):
        compat.swap_class(backup, keras.callbacks.CSVLogger)


def test_patch_is_idempotent_and_reversible():
    class Owner:
        @staticmethod
        def hook(v):
            return v + 1

    calls = []

    def make(fn):
        calls.append(fn)
        return lambda v: fn(v) * 10

    compat.patch(Owner, "hook", make)
    compat.patch(Owner, "hook", make)
    assert len(calls) == 1 and Owner.hook(np.int64(1)) == 20
    assert compat.original(Owner.hook)(1) == 2


def test_import_warns_on_an_untested_keras():
    # A fresh interpreter whose keras reports a version outside the range: the import itself warns, once.
    if not compat.tested_range():
        pytest.skip("torus is not installed (no package metadata)")
    code = ("import warnings, keras\nkeras.__version__ = '3.99.0'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import torus.integrations.keras.compat\n"
            "print(sum('outside the tested range' in str(x.message) for x in w))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"


def _unlisted(sites) -> list[str]:
    """The rows of ``sites`` whose attribute ``compat.REQUIRED`` does not list (an optional row may name a public
    attribute of a public object instead: skipped where a tested Keras lacks it)."""
    def key(owner):
        return owner if isinstance(owner, str) else id(owner)

    required = {(key(owner), name) for owner, names in compat.REQUIRED for name in names}
    out = []
    for site in sites:
        public = not isinstance(site.owner, str) and not site.name.startswith("_")
        if (key(site.owner), site.name) not in required and not (site.optional and public):
            out.append(f"{site.owner}.{site.name}")
    return out


def test_patch_table_rows_are_required_names():
    assert _unlisted(compat.PATCH_SITES) == []
    # the check can fail: a row whose attribute REQUIRED does not list, or a private one marked optional
    extra = compat.Site("trainer.TensorFlowTrainer", "train_on_batch", "fit.fit_hook", "wrap", ("fit",))
    hidden = compat.Site(keras.Model, "_private", "fit.saving", "coordinated", ("x",), optional=True)
    assert _unlisted(compat.PATCH_SITES + (extra, hidden)) == [
        "trainer.TensorFlowTrainer.train_on_batch", f"{keras.Model}._private"]


def test_patch_table_rows_name_their_wrappers():
    from torus.integrations.keras.fit import fit_hook

    sites = [(site.owner, site.name) for site in compat.PATCH_SITES]
    assert len(set(sites)) == len(sites), "one row per attribute"
    for site in compat.PATCH_SITES:
        assert callable(compat.wrapper_of(site)), site
    wrapped = [s.name for s in compat.PATCH_SITES if (s.module, s.wrapper) == ("fit.fit_hook", "wrap")]
    assert wrapped == list(fit_hook.METHODS) and [s.args for s in compat.PATCH_SITES if s.name in wrapped] == [
        (m,) for m in fit_hook.METHODS]


def test_install_wraps_every_row_once():
    compat.install()
    compat.install()  # idempotent
    for site in compat.PATCH_SITES:
        owner = compat._resolve(site.owner)
        if site.optional and not hasattr(owner, site.name):
            continue
        current = getattr(owner, site.name)
        assert compat.is_patched(current) and not compat.is_patched(compat.original(current)), site
        for alias in site.aliases:  # where the module re-exports it (keras.models has no save_weights)
            assert getattr(importlib.import_module(alias), site.name, current) is current, (alias, site)
