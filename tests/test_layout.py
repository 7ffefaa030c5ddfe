"""The test tree must not shadow an installed module.

Several test modules put ``tests/`` on ``sys.path`` (for ``model_factory`` and friends), so each package
under ``tests/`` becomes a top-level import name. When transformers 5.25 began to depend on the ``kernels``
distribution, ``tests/kernels`` hid it and every test that built a transformers model failed at import.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_package_or_helper_shadows_an_installed_distribution() -> None:
    installed = importlib.metadata.packages_distributions()
    ours = {p.parent.name for p in TESTS.glob("*/__init__.py")}
    ours |= {p.stem for p in TESTS.glob("*.py")}
    assert ours, "found no test packages: the glob is wrong"
    clashes = {name: installed[name] for name in sorted(ours) if name in installed}
    assert not clashes, f"rename these so they do not hide installed modules: {clashes}"
