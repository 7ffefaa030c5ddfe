"""KV cache formats: fp8/int8 quantization with per-row scales, memory accounting, block payloads."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.kv_quant import KVCache, KVCacheFormat, dequantize, quantize, resolve_kv_format
from sluice.errors import ConfigError

L, HKV, D, BS = 2, 2, 64, 16
ALL = ["fp32", "bf16", "fp8", "int8"]


def _cache(name: str, num_blocks: int = 6) -> KVCache:
    return KVCache(resolve_kv_format(name, torch.float32), L, num_blocks, HKV, D, BS)


def _fill(cache: KVCache, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(cache.num_blocks * BS)
    for layer in range(L):
        k = torch.randn(len(slots), HKV, D, generator=g) * 3
        v = torch.randn(len(slots), HKV, D, generator=g)
        cache.write(layer, slots, k, v)


def test_auto_resolves_to_the_model_dtype_and_unknown_names_are_rejected() -> None:
    assert resolve_kv_format("auto", torch.float32).name == "fp32"
    assert resolve_kv_format(None, torch.bfloat16).name == "bf16"
    assert resolve_kv_format("fp8", torch.float32).storage_dtype == torch.float8_e4m3fn
    assert resolve_kv_format("int8", torch.bfloat16).storage_dtype == torch.int8
    with pytest.raises(ConfigError, match="fp4"):
        resolve_kv_format("fp4", torch.float32)


def test_bytes_per_block_counts_scales_and_the_block_count_follows_the_dtype() -> None:
    fp32, fp8, int8 = (resolve_kv_format(n, torch.float32) for n in ("fp32", "fp8", "int8"))
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert fp32.bytes_per_block(30, 3, 64) == 2 * 30 * 16 * 3 * 64 * 4
    assert fp8.bytes_per_block(30, 3, 64) == 2 * 30 * 16 * 3 * (64 + 4), "scales are part of the block's cost"
    assert int8.bytes_per_block(30, 3, 64) == fp8.bytes_per_block(30, 3, 64)
    budget = 256 << 20
    ratio = fp8.num_blocks(budget, 30, 3, 64) / fp32.num_blocks(budget, 30, 3, 64)
    assert 3.7 < ratio < 3.8, f"fp8 should hold 256/68 = 3.76x the fp32 blocks, got {ratio:.2f}"


@pytest.mark.parametrize("name", ALL)
def test_the_cache_tensors_take_exactly_the_accounted_bytes(name: str) -> None:
    c = _cache(name)
    tensors = c.k + c.v + c.k_scales + c.v_scales
    assert sum(t.numel() * t.element_size() for t in tensors) == c.num_bytes


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_quantization_error_is_bounded_by_the_row_scale(name: str) -> None:
    fmt = resolve_kv_format(name, torch.float32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, HKV, D, generator=g) * torch.logspace(-3, 4, 512).view(-1, 1, 1)
    data, scales = quantize(x, fmt)
    y = dequantize(data, scales)
    absmax = x.abs().amax(-1)
    torch.testing.assert_close(scales, absmax / (448.0 if name == "fp8" else 127.0))
    err = (x - y).abs()
    if name == "int8":
        bound = scales.unsqueeze(-1) * 0.5 * 1.0001
    else:  # 3 mantissa bits: half an ulp is 1/16 relative; subnormals below 2^-6 have 2^-10 steps
        bound = torch.maximum(x.abs() / 16, scales.unsqueeze(-1) * 2.0**-10) * 1.0001
    assert bool((err <= bound).all()), f"{name}: error above half a quantization step"


def test_large_values_are_not_clipped_by_a_default_scale() -> None:
    """The uncalibrated-scale failure: with scale 1.0, e4m3 saturates at 448."""
    fmt = resolve_kv_format("fp8", torch.float32)
    x = torch.full((1, 1, D), 5000.0)
    x[0, 0, 0] = -12000.0
    data, scales = quantize(x, fmt)
    assert float(scales) != 1.0
    torch.testing.assert_close(dequantize(data, scales), x, rtol=1 / 16, atol=0)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_an_all_zero_row_stays_zero_with_a_finite_scale(name: str) -> None:
    data, scales = quantize(torch.zeros(3, HKV, D), resolve_kv_format(name, torch.float32))
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all())
    assert bool((dequantize(data, scales) == 0).all())


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_block_written_token_by_token_equals_one_written_at_once(name: str) -> None:
    """Later tokens with a larger absmax never rewrite earlier ones: a block's bytes
    do not depend on how its tokens were split across steps (batch invariance)."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(BS, HKV, D, generator=g) * torch.logspace(0, 3, BS).view(-1, 1, 1)  # growing absmax
    v = torch.randn(BS, HKV, D, generator=g)
    whole, steps = _cache(name, 2), _cache(name, 2)
    slots = torch.arange(BS, 2 * BS)  # block 1
    whole.write(0, slots, k, v)
    steps.write(0, slots[:1], k[:1], v[:1])
    first = steps.k[0][1, 0].view(torch.uint8).clone(), steps.k_scales[0][1, 0].clone()
    for lo, hi in ((1, 5), (5, 6), (6, 16)):
        steps.write(0, slots[lo:hi], k[lo:hi], v[lo:hi])
    assert torch.equal(steps.k[0][1, 0].view(torch.uint8), first[0]) and torch.equal(steps.k_scales[0][1, 0], first[1]), \
        "token 0 was rewritten when a larger token arrived"
    for a, b in ((whole.k, steps.k), (whole.v, steps.v), (whole.k_scales, steps.k_scales), (whole.v_scales, steps.v_scales)):
        assert torch.equal(a[0][1].view(torch.uint8), b[0][1].view(torch.uint8)), "chunking changed the block's bytes"


@pytest.mark.parametrize("name", ALL)
def test_gather_returns_the_written_values_up_to_quantization(name: str) -> None:
    c = _cache(name)
    k = torch.randn(40, HKV, D)
    v = torch.randn(40, HKV, D)
    table = torch.tensor([4, 1, 3])
    slots = torch.cat([table[i // BS : i // BS + 1] * BS + i % BS for i in range(40)])
    c.write(1, slots, k, v)
    kk, vv = c.gather(1, table, 40, torch.float32)
    tol = {"fp32": 0.0, "bf16": 2**-8, "fp8": 1 / 16, "int8": 1 / 127}[name]
    for a, b in ((kk, k), (vv, v)):
        bound = tol * b.abs().amax(-1, keepdim=True) if name in ("fp8", "int8") else tol * b.abs()
        assert bool(((a - b).abs() <= bound + 1e-7).all()), f"{name}: gathered values differ from the written ones"


@pytest.mark.parametrize("name", ALL)
def test_block_payloads_round_trip_bit_exact(name: str) -> None:
    src, dst = _cache(name), _cache(name)
    _fill(src)
    payloads = src.export_blocks([2, 5, 0])
    assert payloads.shape == (3, src.bytes_per_block) and payloads.dtype == torch.uint8
    for block, row in zip([1, 4, 3], payloads):
        dst.import_block(block, bytearray(row.numpy().tobytes()))
    for s_ids, d_ids in (([2, 5, 0], [1, 4, 3]),):
        for a, b in ((src.k, dst.k), (src.v, dst.v), (src.k_scales, dst.k_scales), (src.v_scales, dst.v_scales)):
            for layer in range(len(a)):
                for s, d in zip(s_ids, d_ids):
                    assert torch.equal(a[layer][s].view(torch.uint8), b[layer][d].view(torch.uint8))
    assert torch.equal(dst.export_blocks([1, 4, 3]), payloads), "export(import(x)) != x"


def test_import_rejects_a_payload_of_the_wrong_size() -> None:
    c = _cache("fp8")
    with pytest.raises(ValueError, match="expected"):
        c.import_block(0, bytearray(c.bytes_per_block - 1))


def test_format_is_a_value() -> None:
    assert resolve_kv_format("fp8", torch.float32) == KVCacheFormat("fp8", torch.float8_e4m3fn)
