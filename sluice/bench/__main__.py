"""``python -m sluice.bench ...`` is ``sluice bench ...`` without the other layers' commands."""

from sluice.bench.cli import bench_app

bench_app(prog_name="sluice bench")
