"""Every ``>>>`` example in the package's docstrings runs and prints what it
says (README, "API at a glance": each name's docstring shows it in use)."""

import doctest
import importlib
import pkgutil

import pytest


def _modules():
    names = []
    for pkg in ("tf_sfctr", "tf_sfctr.keras_layers", "tf_sfctr.data", "tf_sfctr.distributed"):
        names.append(pkg)
        path = importlib.import_module(pkg).__path__
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(path)]
    return [n for n in dict.fromkeys(names) if not n.endswith("_sfctr_ops")]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS,
                             report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"

