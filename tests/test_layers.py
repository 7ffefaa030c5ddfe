"""The layer rules of DESIGN.md hold: import-linter contracts (pyproject.toml), and at
run time the gateway and the bench load neither torch nor the engine, not even
through ``sluice/__init__.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    pytest.importorskip("importlinter")
    r = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, f"an import breaks a layer rule (see DESIGN.md):\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


@pytest.mark.parametrize(
    "modules",
    [
        "sluice.gateway.app, sluice.gateway.cli, sluice.gateway.launchers.local",
        "sluice.bench.cli, sluice.bench.session, sluice.bench.fake_server",
        "sluice, sluice.obs.tracing, sluice.obs.cli, sluice.settings, sluice.http_errors",
    ],
)
def test_http_layers_load_no_torch_and_no_engine_at_run_time(modules: str) -> None:
    code = (
        f"import sys, {modules};"
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith(('sluice.engine', 'sluice.models', 'sluice.kernels', 'sluice.server'))])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"importing {modules} must not load torch or the engine: {r.stdout}"
