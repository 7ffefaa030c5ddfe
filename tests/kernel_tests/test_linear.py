"""Linear: quantized, invariant-float and BLAS parts behind one interface; the C++ op and the Python
path agree; the manifest rebuilds a module from cached tensors; kernel plans come from measurement."""

from __future__ import annotations

import json

import pytest
import torch

from sluice.kernels import autotune, ext
from sluice.kernels import qlinear as ql
from sluice.kernels.linear import BUCKETS, Linear, make_linear, pack_fp32, unpack_fp32
from tests.kernel_tests.test_qgemm import rand_qweight


def test_compatible_quantized_parts_are_packed_as_one_matrix() -> None:
    q, k, v = (rand_qweight(n, 64, 4, 32, seed=i) for i, n in enumerate((64, 32, 32)))
    lin = make_linear([q, k, v])
    assert [kind for kind, _, _ in lin.parts] == ["quant"], "one packed matrix, one kernel call"
    x = torch.randn(3, 64)
    ref = torch.cat([make_linear([p])(x) for p in (q, k, v)], dim=1)
    assert torch.equal(lin(x), ref), "stacking rows must not change any output"


def test_mixed_parts_write_their_own_columns() -> None:
    q = rand_qweight(48, 64, 4, 32)
    v8 = rand_qweight(16, 64, 8, 32, z=128, with_min=False, seed=5)  # a different form: its own part
    f = torch.randn(32, 64)
    lin = make_linear([q, v8, f], bias=torch.randn(96), invariant=True)
    assert [kind for kind, _, _ in lin.parts] == ["quant", "quant", "fp32"]
    lin.prepare()
    assert lin.op is not None
    x = torch.randn(5, 64)
    y = lin(x)
    expect = x.double() @ torch.cat([q.dequantize(), v8.dequantize(), f]).double().T + lin.bias.double()
    assert ((y.double() - expect).abs().max() / expect.abs().max()) < 2e-2, "int8 activations: ~1% error at most"
    op, lin.op = lin.op, None  # the Python path (no C++ op): the same quantized columns, bit for bit
    py = lin(x)
    assert torch.equal(py[:, :64], y[:, :64])
    assert torch.allclose(py[:, 64:], y[:, 64:], rtol=1e-5, atol=1e-5), "float columns: BLAS instead of the fixed-order kernel"
    lin.op = op
    resid = torch.randn(5, 96)
    expect_r = resid + y
    assert torch.equal(lin(x, residual=resid), expect_r) and lin(x, residual=resid) is resid


@pytest.mark.parametrize("n", [40, 117, 2000])  # 3 tiles (a pass of 2, then 1), 8, 125 (chunks on threads)
def test_fp32_parts_are_exact_float_and_batch_invariant(n: int) -> None:
    """Every ISA path, every row count (passes of up to 8 rows over up to 4 tiles, NOTE(fp32-streams)):
    a row's bits do not depend on the rows beside it or on the path."""
    w = torch.randn(n, 96)
    assert torch.equal(unpack_fp32(pack_fp32(w), n), w)
    lin = make_linear([w], invariant=True)
    rows = torch.randn(19, 96)
    alone: torch.Tensor | None = None
    for path in ql.available_paths():
        lin.plan.default = path
        lin.prepare()
        assert lin.op is not None
        mine = torch.cat([lin(rows[i : i + 1]) for i in range(len(rows))])
        assert torch.allclose(mine, rows @ w.T, rtol=1e-5, atol=1e-4)
        if alone is None:
            alone = mine
        assert torch.equal(mine, alone), f"{path.label}: the same bits as every other path"
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 19):
            assert torch.equal(lin(rows[:m]), alone[:m]), f"{path.label}, {m} rows: a row's bits as alone"


def test_manifest_rebuilds_the_module_from_its_state_dict() -> None:
    lin = make_linear([rand_qweight(32, 64, 4, 32), torch.randn(16, 64)], bias=torch.randn(48), invariant=True)
    manifest = json.loads(json.dumps(lin.manifest()))  # survives JSON, as in the cache
    rebuilt = Linear.from_manifest(64, 48, manifest, torch.float32)
    rebuilt.load_state_dict(lin.state_dict(), strict=True, assign=True)
    rebuilt.prepare()
    lin.prepare()
    x = torch.randn(4, 64)
    assert torch.equal(rebuilt(x), lin(x))


def test_plan_measures_each_shape_once_and_caches_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_KERNEL_PATH", raising=False)
    model = torch.nn.ModuleList([make_linear([rand_qweight(32, 64, 4, 32)]), make_linear([rand_qweight(32, 64, 4, 32, seed=1)])])
    label = autotune.plan_kernels(model)
    doc = json.loads((tmp_path / "autotune-v6.json").read_text())
    (entry,) = doc.values()
    assert list(entry) == ["32,64,0"], "one measurement per distinct shape"
    assert all(p in {p.label for p in ql.available_paths()} for p in entry["32,64,0"])
    assert set(label.split("+")) <= {p.label for p in ql.available_paths()}
    assert all(isinstance(m, Linear) and m.op is not None for m in model)
    calls = []
    monkeypatch.setattr(autotune, "measure_shape", lambda *a: calls.append(a) or [])
    autotune.plan_kernels(model)
    assert not calls, "a second start reads the cache instead of measuring"
    assert len(entry["32,64,0"]) == len(BUCKETS)
    entry["32,64,0"] = entry["32,64,0"][:-1]  # a plan of another bucket count (NOTE(bucket-8))
    (tmp_path / "autotune-v6.json").write_text(json.dumps(doc))
    monkeypatch.setattr(autotune, "measure_shape", lambda *a: calls.append(a) or [ql.available_paths()[0]] * len(BUCKETS))
    autotune.plan_kernels(model)
    assert len(calls) == 1, "a cached plan with another bucket count is measured again"


def test_forcing_a_path_the_cpu_lacks_is_a_clear_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.ModuleList([make_linear([rand_qweight(16, 32, 4, 32)])])
    monkeypatch.setenv("SLUICE_KERNEL_PATH", "sse9")
    with pytest.raises(ValueError, match="SLUICE_KERNEL_PATH"):
        autotune.plan_kernels(model)


def test_plan_is_filed_under_the_threads_the_gemms_run_on() -> None:
    """NOTE(plan-threads): an engine on the work pool leaves torch one thread; its plan is the pool's."""
    before_pool, before_torch = ext.work_pool_threads(), torch.get_num_threads()
    try:
        ext.set_work_pool(2)
        torch.set_num_threads(1)
        assert autotune.kernel_threads() == 2
        assert autotune.cpu_key().endswith("|threads=2")
        ext.set_work_pool(0)
        assert autotune.cpu_key().endswith("|threads=1")
    finally:
        ext.set_work_pool(before_pool)
        torch.set_num_threads(before_torch)


def test_a_float_only_layer_of_a_quantized_model_gets_the_plan(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An int4 model's float head (an invariant float layer, no quantized part) ran the scalar loop: it had
    no plan, and KernelPlan's default is SCALAR.  It now shares the model's plan (its default ISA)."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SLUICE_KERNEL_PATH", raising=False)
    head = make_linear([torch.randn(64, 32)], invariant=True)
    model = torch.nn.ModuleList([make_linear([rand_qweight(32, 64, 4, 32)]), head])
    assert head.plan.default is ql.Path.SCALAR
    autotune.plan_kernels(model)
    assert head.plan is model[0].plan and head.plan.default is ql.available_paths()[0]
    assert head.op is not None
    x = torch.randn(3, 32)
    assert torch.equal(head(x)[1:2], head(x[1:2])), "still batch invariant"
