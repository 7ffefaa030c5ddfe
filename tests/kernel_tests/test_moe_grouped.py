"""The grouped expert GEMM (sluice/kernels/csrc/moe_op.cpp, NOTE(grouped-op)): one C++ call per MoE layer
gives the bits of the Python grouped loop and of running each token's experts one by one, on every kernel
path this CPU has and with paths mixed per row count; a row's output does not depend on the rows beside it;
every expert gets rows here; anything the op cannot run falls back to the loop."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sluice.kernels import qlinear as ql
from sluice.kernels.linear import BUCKETS, KernelPlan, Linear
from sluice.kernels.qweight import QuantWeight
from sluice.models.moe import MoEBlock, route

PATHS = ql.available_paths()
HID, INTER, NEXP = 64, 96, 8  # hidden, expert intermediate (gate_up: 12 tiles of 16), experts


def q4_0_like(n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """A random Q4_0-like weight: 4-bit q, z = 8, fp16-exact scales per 32."""
    d = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.01).half().float()
    return QuantWeight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, torch.zeros_like(d), 4, 32, 8)


def make_block(top_k: int = 3, normalize: bool = True, act: str = "silu", float_expert: int | None = None,
               seed: int = 0) -> MoEBlock:  # fmt: skip
    cfg = SimpleNamespace(hidden_size=HID, moe_intermediate_size=INTER, num_experts=NEXP, num_experts_per_tok=top_k,
                          norm_topk_prob=normalize, hidden_act=act)  # fmt: skip
    block = MoEBlock(cfg)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    experts: list[tuple[Any, Any, Any]] = []
    for e in range(NEXP):
        gate, up, down = q4_0_like(INTER, HID, gen), q4_0_like(INTER, HID, gen), q4_0_like(HID, INTER, gen)
        experts.append((gate, up, down.dequantize() if e == float_expert else down))
    block.load(torch.randn(NEXP, HID, generator=gen) * 0.5, experts, invariant=True)
    plan_block(block, KernelPlan(default=PATHS[0]))
    return block


def plan_block(block: MoEBlock, plan: KernelPlan) -> None:
    for lin in block.modules():
        if isinstance(lin, Linear):
            lin.plan = plan
            lin.prepare()


def silu_act(gu: torch.Tensor) -> torch.Tensor:
    return ql.kernel_module().silu_mul(gu)  # type: ignore[no-any-return]  # what Ops.act_mul runs in float32


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HID, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("path", [p.label for p in PATHS] + ["mixed"])
def test_one_call_gives_the_bits_of_the_loop_and_of_experts_one_by_one(path: str) -> None:
    block = make_block()
    if path == "mixed":  # a path per row count: the vector path below 16 rows, the last (scalar) above
        paths = [PATHS[0], PATHS[0], PATHS[-1], PATHS[-1], PATHS[-1]]
        if ql.Path.AMX in PATHS:
            paths[2:] = [ql.Path.AMX] * 3
        plan = KernelPlan(default=PATHS[0], by_shape={(2 * INTER, HID, ql.MODE_W4): paths, (HID, INTER, ql.MODE_W4): paths[::-1]})
    else:
        plan = KernelPlan(default=ql.Path[path.upper()])
    plan_block(block, plan)
    op = block.grouped_op()
    assert op is not None, "quantized experts in float32 on the CPU run on the C++ op"
    for t in (1, 5, 64):  # 64 x 3 slots: experts of up to ~40 rows (several 8-row tiles, the 16+ bucket)
        x = rows(t, seed=t)
        w, ids = block.route(x)
        if t == 64:
            counts = torch.bincount(ids.flatten(), minlength=NEXP)
            assert bool((counts > 0).all()), f"every expert gets rows here: {counts.tolist()}"
            assert int(counts.max()) > 16, "an expert runs over more rows than one tile call and its bucket's top"
        grouped = block(x, silu_act)
        assert torch.equal(grouped, block.forward_loop(x, silu_act, w, ids)), f"{path}, {t} rows: the Python loop's bits"
        assert torch.equal(grouped, block.forward_one_by_one(x, silu_act)), f"{path}, {t} rows: one by one"
        resid = rows(t, seed=100 + t)
        want = block.forward_loop(x, silu_act, w, ids, residual=resid.clone())
        assert torch.equal(block(x, silu_act, residual=resid.clone()), want), "the residual add, in slot order"


def test_every_path_gives_the_same_bits() -> None:
    block = make_block(top_k=2, normalize=False)
    x = rows(37, seed=7)
    outs = {}
    for p in PATHS:
        plan_block(block, KernelPlan(default=p))
        outs[p] = block(x, silu_act)
    for p, out in outs.items():
        assert torch.equal(out, outs[PATHS[0]]), f"{p.label} and {PATHS[0].label} differ: every path has the same bits"


def test_a_rows_output_does_not_depend_on_its_batch() -> None:
    block = make_block()
    x = rows(48, seed=3)
    full = block(x, silu_act)
    gen = torch.Generator().manual_seed(4)
    for n in (1, 2, 7, 17, 31):
        sub = torch.randperm(48, generator=gen)[:n]
        assert torch.equal(block(x[sub], silu_act), full[sub]), f"rows {sub.tolist()} alone differ from in the batch"
    twice = torch.cat([x[:5], x[:5]])  # a row beside a copy of itself: its expert gets two equal rows
    assert torch.equal(block(twice, silu_act), torch.cat([full[:5], full[:5]]))


def test_the_ops_routing_picks_what_torch_picks() -> None:
    block = make_block(top_k=3, normalize=True)
    x = rows(200, seed=9)
    w, ids = block.route(x)
    w_ref, ids_ref = route(block.router(x), 3, True)
    assert torch.equal(ids, ids_ref), "the same experts, in the same slot order (probability down)"
    assert torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7), "the same weights, to the last bits of exp"
    assert torch.allclose(w.sum(-1), torch.ones(200)), "renormalised top-k weights sum to 1"
    block = make_block(top_k=2, normalize=False)
    w, ids = block.route(x)
    w_ref, ids_ref = route(block.router(x), 2, False)
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7)


def test_the_layer_is_one_call_the_expert_linears_are_not_run() -> None:
    block = make_block()
    x = rows(9, seed=1)
    want = block(x, silu_act)
    w, ids = block.route(x)

    def refuse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("an expert linear ran from Python")

    for ex in block.experts:
        ex.gate_up.forward = refuse  # type: ignore[method-assign]
        ex.down.forward = refuse  # type: ignore[method-assign]
    assert torch.equal(block(x, silu_act), want)


def test_what_the_op_cannot_run_falls_back_to_the_loop() -> None:
    mixed = make_block(float_expert=5)  # one expert's down kept in float (a fallback layer)
    assert mixed.grouped_op() is None, "an expert that is not one quantized matrix per linear: the loop serves"
    x = rows(20, seed=2)
    w, ids = mixed.route(x)
    assert torch.equal(mixed(x, silu_act), mixed.forward_loop(x, silu_act, w, ids))
    assert make_block(act="gelu_tanh").grouped_op() is None, "the op computes SiLU only"
    unprepared = make_block()
    for lin in unprepared.modules():
        if isinstance(lin, Linear):
            lin.op = None
    assert unprepared.grouped_op() is None, "no kernel ops (no extension): the loop"


def test_a_new_plan_rebuilds_the_op() -> None:
    block = make_block()
    first = block.grouped_op()
    assert block.grouped_op() is first, "built once while the linears stay"
    plan_block(block, KernelPlan(default=PATHS[-1]))
    assert block.grouped_op() is not first, "the linears' ops were rebuilt: so is the grouped op"


def test_bad_input_gets_a_clear_error() -> None:
    block = make_block()
    op = block.grouped_op()
    with pytest.raises(RuntimeError, match=r"x \(T, 64\) float32"):
        op.forward(torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="residual"):
        op.forward(torch.randn(3, HID), None, torch.randn(2, HID))
    with pytest.raises(RuntimeError, match="logits"):
        op.route(torch.randn(3, HID), torch.randn(3, NEXP + 1))
    pw, _, _ = block.experts[0].gate_up.quant_kernel_args()
    with pytest.raises(RuntimeError, match="does not match"):
        op.set_expert(0, 1, pw.data, pw.scale, pw.mins, pw.group_size, pw.mode, [BUCKETS[-1]], [0])  # gate_up as down
    unsupported = [p for p in ql.Path if p not in PATHS]
    if unsupported:
        with pytest.raises(RuntimeError, match="not supported by this CPU"):
            op.set_expert(0, 0, pw.data, pw.scale, pw.mins, pw.group_size, pw.mode, [BUCKETS[-1]], [int(unsupported[0])])
    with pytest.raises(RuntimeError, match="top_k"):
        ql.kernel_module().MoEOp(HID, INTER, NEXP, NEXP + 1, True)
