"""Attention over fp32 / bf16 / fp8 / int8 KV caches: the C++ kernel against the torch reference, and end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchAttention,
    available_backends,
)
from sluice.engine.core import EngineCore
from sluice.engine.kv_quant import KVCache, resolve_kv_format
from sluice.engine.protocol import EngineRequest, SamplingParams

H, HKV, D = 4, 2, 64
needs_kernel = pytest.mark.skipif("cpu_paged" not in available_backends("cpu"), reason="no C++ toolchain")


def _batch(kv: KVCache, dtype: torch.dtype, seed: int = 0) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode (context 37), a continuing prefill chunk (5 new of 50) and a fresh prefill (20 tokens)."""
    g = torch.Generator().manual_seed(seed)
    tables, ctxs, qls = [[3, 7, 1], [2, 9, 4, 11], [5, 6]], [37, 50, 20], [1, 5, 20]
    for t, c, ql in zip(tables, ctxs, qls):
        n = c - ql
        if n:
            slots = torch.tensor([t[p // 16] * 16 + p % 16 for p in range(n)])
            kv.write(0, slots, (torch.randn(n, HKV, D, generator=g) * 3).to(dtype), torch.randn(n, HKV, D, generator=g).to(dtype))
    slots = torch.tensor([t[p // 16] * 16 + p % 16 for t, c, ql in zip(tables, ctxs, qls) for p in range(c - ql, c)])
    total = sum(qls)
    q, k, v = (torch.randn(total, n, D, generator=g).to(dtype) for n in (H, HKV, HKV))
    bt = torch.zeros(len(tables), 4, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl = [0, 1, 6, 26]
    meta = AttentionMetadata(slots, qsl, ctxs, bt, [len(t) for t in tables],
                             torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32))
    return meta, q, k, v


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_every_cache_format_like_the_reference(kv_dtype: str, dtype: torch.dtype) -> None:
    outs = []
    for cls in (TorchAttention, CpuPagedAttention):
        kv = KVCache(resolve_kv_format(kv_dtype, dtype), 1, 16, HKV, D)
        meta, q, k, v = _batch(kv, dtype)
        backend = cls(kv, D**-0.5)
        backend.set_metadata(meta)
        outs.append(backend(0, q, k, v).float())
    # bf16 queries: the reference rounds dequantized K/V to bf16, the kernel keeps float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@needs_kernel
def test_the_kernel_decodes_every_fp8_code_exactly_even_with_flush_to_zero() -> None:
    """Context of one key: the output is that key's V row, i.e. the dequantized codes."""
    fmt = resolve_kv_format("fp8", torch.float32)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    codes = torch.cat([codes, codes[: 256 - len(codes)]]).view(4, D)  # 4 rows of 64 codes
    kv = KVCache(fmt, 1, 4, 1, D)
    kv.k[0].view(torch.uint8).zero_()
    kv.v[0].view(torch.uint8)[:, 0, 0, :] = codes
    kv.k_scales[0].fill_(1.0)
    kv.v_scales[0][:, 0, 0] = torch.tensor([0.5, 1.0, 2.0, 0.125])
    backend = CpuPagedAttention(kv, 1.0)
    meta = AttentionMetadata(torch.tensor([0, 16, 32, 48]), [0, 1, 2, 3, 4], [1, 1, 1, 1],
                             torch.arange(4, dtype=torch.int32).view(4, 1), [1] * 4,
                             torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32))
    backend.set_metadata(meta)
    k_new = torch.zeros(4, 1, D)
    v_new = codes.view(torch.float8_e4m3fn).float() * kv.v_scales[0][:, 0, :1].clone()
    kv.write = lambda *a: None  # type: ignore[method-assign]  # keep the planted codes
    ftz = torch.set_flush_denormal(True)
    try:
        out = backend(0, torch.zeros(4, 1, D), k_new, v_new)
    finally:
        if ftz:
            torch.set_flush_denormal(False)
    assert torch.equal(out[:, 0], v_new), "an fp8 code decodes to another value in the kernel"


def _generate(model_dir: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], EngineCore]:
    engine = EngineCore(model=str(model_dir), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
                        kv_cache_memory=2 << 20, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))], engine


def _prompts(n: int, length: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (length,), generator=g).tolist() for _ in range(n)]


def _first_logits(model_dir: Path, prompts: list[list[int]], **kw: object) -> tuple[torch.Tensor, EngineCore]:
    engine = EngineCore(model=str(model_dir), dtype="float32", max_num_batched_tokens=4096, max_num_seqs=64,
                        kv_cache_memory=2 << 20, **kw)
    engine.runner.capture_logits = True
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=p, sampling=SamplingParams(max_tokens=1)))
    engine.step()  # one step: every prompt prefills and samples
    assert engine.runner.last_logits is not None and not engine.has_unfinished_requests()
    return engine.runner.last_logits.log_softmax(-1), engine


# NOTE(tiny-model-margins): the tiny random model's top-2 logit margins are small
# (median 0.23), so greedy tokens flip even under bf16 KV; the distribution is
# what these tests bound.  Accuracy on a real model is benchmarks/kv_accuracy.py.
@pytest.mark.parametrize(("kv_dtype", "max_kl"), [("bf16", 1e-3), ("int8", 5e-3), ("fp8", 5e-2)])
def test_quantized_kv_cache_keeps_the_next_token_distribution(tiny_llama: Path, kv_dtype: str, max_kl: float) -> None:
    prompts = _prompts(16, 40)
    ref, e32 = _first_logits(tiny_llama, prompts)
    got, eq = _first_logits(tiny_llama, prompts, kv_cache_dtype=kv_dtype)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < max_kl, f"{kv_dtype} KV: mean next-token KL to fp32 {float(kl.mean()):.2e}"
    if kv_dtype in ("fp8", "int8"):
        d = e32.runner.model_config.head_dim
        want = 4 * d / (d + 4)  # fp32 bytes per (token, head) over 1-byte codes + a float32 scale
        assert eq.runner.num_blocks >= 0.97 * want * e32.runner.num_blocks, f"{kv_dtype} should hold {want:.2f}x the blocks"


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_a_prefix_hit_in_a_quantized_cache_equals_a_cold_run(tiny_llama: Path, kv_dtype: str) -> None:
    shared = _prompts(1, 48, seed=3)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    cold, _ = _generate(tiny_llama, [b], kv_cache_dtype=kv_dtype)
    engine = EngineCore(model=str(tiny_llama), dtype="float32", max_num_batched_tokens=64, kv_cache_memory=2 << 20,
                        kv_cache_dtype=kv_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs: dict[str, list[int]] = {"a": [], "b": []}
    cached = {}
    for rid, p in (("a", a), ("b", b)):
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling=params))
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id].extend(o.new_token_ids)
                cached[o.request_id] = o.num_cached_tokens
    assert cached["b"] == 48, "the shared 48-token prefix should come from the cache"
    assert outs["b"] == cold[0], "a prefix hit must give the cold run's tokens"


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_the_kernel_writes_new_kv_from_slices_of_the_fused_projection(kv_dtype: str) -> None:
    """NOTE(kv-write): an unquantized cache gets its new K/V from the kernel itself, read
    from uncopied slices of the QKV output; the cache and the output equal the reference's."""
    caches, outs = [], []
    for cls, qkv_rows in ((TorchAttention, False), (CpuPagedAttention, False), (CpuPagedAttention, True)):
        kv = KVCache(resolve_kv_format(kv_dtype, torch.float32), 1, 16, HKV, D)
        kv.k[0].zero_()  # the slots no one writes compare equal too
        kv.v[0].zero_()
        meta, q, k, v = _batch(kv, torch.float32, seed=3)
        fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # (T, (H + 2 Hkv) D)
        qs, ks, vs = fused.split([H * D, HKV * D, HKV * D], dim=1)
        views = [x.view(-1, n, D) for x, n in ((qs, H), (ks, HKV), (vs, HKV))]
        assert not views[0].is_contiguous()
        backend = cls(kv, D**-0.5)
        backend.set_metadata(meta)
        # NOTE(qkv-rows): or the projection's rows whole, sliced by the kernel
        out = backend.attend_qkv(0, fused, H) if qkv_rows else backend(0, *views).flatten(1)
        outs.append(out)
        caches.append((kv.k[0].clone(), kv.v[0].clone()))
    for cache, out in zip(caches[1:], outs[1:]):
        assert torch.equal(cache[0], caches[0][0]) and torch.equal(cache[1], caches[0][1])
        tol = 1e-5 if kv_dtype == "fp32" else 2e-2
        torch.testing.assert_close(out, outs[0], atol=tol, rtol=tol)
    assert torch.equal(outs[2], outs[1]), "the same kernel on the same rows, sliced in C++ or in Python"


@needs_kernel
def test_a_slot_outside_the_cache_is_a_clear_error_not_a_stray_write() -> None:
    kv = KVCache(resolve_kv_format("fp32", torch.float32), 1, 16, HKV, D)
    meta, q, k, v = _batch(kv, torch.float32)
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[-1] = 16 * 16  # one past the last slot of 16 blocks
    backend = CpuPagedAttention(kv, D**-0.5)
    backend.set_metadata(meta)
    with pytest.raises(RuntimeError, match="outside the cache"):
        backend(0, q, k, v)


def _rows(kv: KVCache, rows: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0,
          heads: int = H) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of (context, new tokens), each on its own blocks (scattered, in reverse), their earlier K/V
    written with the sequence's own seed: a row's inputs are the same whatever batch it is in."""
    tables, qs, ks, vs, slots = [], [], [], [], []
    free = list(range(kv.k[0].shape[0]))[::-1]
    bs, hkv, d = kv.block_size, kv.num_kv_heads, kv.head_dim
    for ctx, ql in rows:
        g = torch.Generator().manual_seed(seed * 1000 + ctx * 7 + ql)
        table = [free.pop() for _ in range((ctx + bs - 1) // bs)]
        tables.append(table)
        n = ctx - ql
        if n:
            old = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
            kv.write(0, old, (torch.randn(n, hkv, d, generator=g) * 3).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype))
        slots += [table[p // bs] * bs + p % bs for p in range(n, ctx)]
        qs.append(torch.randn(ql, heads, d, generator=g).to(dtype))
        ks.append(torch.randn(ql, hkv, d, generator=g).to(dtype))
        vs.append(torch.randn(ql, hkv, d, generator=g).to(dtype))
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl = [0]
    for _, ql in rows:
        qsl.append(qsl[-1] + ql)
    ctxs = [c for c, _ in rows]
    meta = AttentionMetadata(torch.tensor(slots), qsl, ctxs, bt, [len(t) for t in tables],
                             torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32))
    return meta, torch.cat(qs), torch.cat(ks), torch.cat(vs)


def _attend(cls: type, kv_dtype: str, dtype: torch.dtype, rows: list[tuple[int, int]]) -> list[torch.Tensor]:
    kv = KVCache(resolve_kv_format(kv_dtype, dtype), 1, 400, HKV, D)
    meta, q, k, v = _rows(kv, rows, dtype)
    backend = cls(kv, D**-0.5)
    backend.set_metadata(meta)
    out = backend(0, q, k, v)
    return list(out.split([ql for _, ql in rows]))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_longer_than_a_key_segment_match_the_reference(kv_dtype: str, dtype: torch.dtype) -> None:
    # NOTE(key-segments): rows of more than 512 keys are cut into segments merged afterwards:
    # decodes of 513, 1100 and 2048 keys, a prefill chunk crossing 512 and 1024, a short decode
    rows = [(513, 1), (1100, 1), (2048, 1), (1030, 40), (37, 1)]
    ref, got = _attend(TorchAttention, kv_dtype, dtype, rows), _attend(CpuPagedAttention, kv_dtype, dtype, rows)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol, msg=lambda m, i=i: f"row {rows[i]}: {m}")


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_a_row_gives_the_same_bits_alone_and_beside_long_rows(kv_dtype: str) -> None:
    # batch invariance across the two ways of running the kernel (a batch with a row over 512 keys
    # goes through the segment work list, one without does not): a row's bits depend on it alone
    long_rows, short_rows = [(1100, 1), (2048, 1), (1030, 40)], [(37, 1), (512, 1), (300, 12)]
    together = _attend(CpuPagedAttention, kv_dtype, torch.float32, long_rows + short_rows)
    for i, row in enumerate(long_rows + short_rows):
        alone = _attend(CpuPagedAttention, kv_dtype, torch.float32, [row])[0]
        assert torch.equal(alone, together[i]), f"row {row} differs alone and in the batch"
    shorts = _attend(CpuPagedAttention, kv_dtype, torch.float32, short_rows)
    for i, row in enumerate(short_rows):
        assert torch.equal(shorts[i], together[len(long_rows) + i]), f"row {row}: short batch against a long one"


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_every_head_dim_and_block_size_matches_the_reference(head_dim: int, block_size: int, kv_dtype: str) -> None:
    # NOTE(attn-simd): head dims of 16, 64 and 128 run on the vector path (scores 16 keys at a
    # time, so a 32-token block is two passes and short last blocks leave lanes unused); 32 and 48 run
    # the generic loops. Rows of 1-70 keys, decodes and prefill chunks, on scattered blocks.
    rows = [(1, 1), (15, 1), (17, 1), (33, 1), (70, 1), (40, 9), (21, 21)]
    outs = []
    for cls in (TorchAttention, CpuPagedAttention):
        kv = KVCache(resolve_kv_format(kv_dtype, torch.float32), 1, 64, 2, head_dim, block_size=block_size)
        meta, q, k, v = _rows(kv, rows, torch.float32, seed=head_dim, heads=6)
        backend = cls(kv, head_dim**-0.5)
        backend.set_metadata(meta)
        outs.append(backend(0, q, k, v))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def _masked_reference(kv: KVCache, meta: AttentionMetadata, q: torch.Tensor, scale: float, window: int | None,
                      softcap: float | None) -> torch.Tensor:  # fmt: skip
    from sluice.models.attention import masked_attention

    out = []
    for i in range(meta.num_seqs):
        s, e, ctx = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
        kk, vv = kv.gather(0, meta.block_tables[i, : meta.num_blocks_per_seq[i]].long(), ctx, torch.float32)
        out.append(masked_attention(q[s:e].float(), kk, vv, scale=scale, window=window, softcap=softcap))
    return torch.cat(out)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize(("window", "softcap"), [(32, None), (600, None), (None, 5.0), (40, 2.0)])
def test_the_kernel_attends_a_window_and_soft_caps_like_the_masked_reference(kv_dtype: str, head_dim: int,
                                                                             window: int | None,
                                                                             softcap: float | None) -> None:  # fmt: skip
    """NOTE(window-keys): decodes and prefill chunks, rows past one key segment (600-key windows of 1100-token
    rows are cut), a window starting mid-block; every table entry wholly before the step's window points at
    a block of NaNs, which any read would spread into the output."""
    rows = [(100, 1), (37, 1), (700, 1), (1100, 40), (90, 90), (530, 7)]
    kv = KVCache(resolve_kv_format(kv_dtype, torch.float32), 1, 400, HKV, head_dim)
    meta, q, k, v = _rows(kv, rows, torch.float32, seed=3)
    scale = 0.11
    backend = CpuPagedAttention(kv, scale)
    backend.set_metadata(meta)
    got = backend.attend_ext(0, q, k, v, scale=scale, window=window, softcap=softcap)  # writes the new K/V first
    ref = _masked_reference(kv, meta, q, scale, window, softcap)
    poisoned = meta.block_tables.clone()
    if kv.fmt.is_quantized:  # codes of 1 at scales of NaN
        for x in (kv.k[0][399], kv.v[0][399]):
            x.fill_(1)
        for x in (kv.k_scales[0][399], kv.v_scales[0][399]):
            x.fill_(float("nan"))
    else:
        kv.k[0][399].fill_(float("nan"))
        kv.v[0][399].fill_(float("nan"))
    for i, (ctx, ql) in enumerate(rows):
        first = max(0, ctx - ql - (window or ctx) + 1)
        poisoned[i, : first // kv.block_size] = 399
    meta.block_tables = poisoned
    backend.set_metadata(meta)
    again = backend.attend_ext(0, q, k, v, scale=scale, window=window, softcap=softcap)
    assert not again.isnan().any(), "a block before the window was read"
    assert torch.equal(again, got), "the blocks before the window change nothing"
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_a_windowed_row_gives_the_same_bits_however_its_prompt_is_chunked() -> None:
    """Chunk invariance with a window: the last 30 queries of an 80-token prompt, computed with the first 50 or
    after them, give the same bits (each row reads exactly its own window, from its own first key)."""
    g = torch.Generator().manual_seed(5)
    kv = KVCache(resolve_kv_format("fp32", torch.float32), 1, 16, HKV, D)
    table = [4, 9, 2, 7, 11]
    q, k, v = torch.randn(80, H, D, generator=g), torch.randn(80, HKV, D, generator=g), torch.randn(80, HKV, D, generator=g)
    backend = CpuPagedAttention(kv, 0.125)

    def step(start: int, n: int) -> torch.Tensor:
        slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(start, start + n)])
        bt = torch.tensor([table], dtype=torch.int32)
        meta = AttentionMetadata(slots, [0, n], [start + n], bt, [len(table)], torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([start + n], dtype=torch.int32))  # fmt: skip
        backend.set_metadata(meta)
        return backend.attend_ext(0, q[start : start + n], k[start : start + n], v[start : start + n], scale=0.125,
                                  window=20, softcap=3.0)  # fmt: skip

    whole = step(0, 80)
    step(0, 50)
    assert torch.equal(step(50, 30), whole[50:])
