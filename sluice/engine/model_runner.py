"""Runs one scheduled step on the model: flattens the batch, runs, samples.

The runner owns the model weights, the KV cache tensors and the attention
backend; it makes no policy decisions.  For each scheduled request it lays
out ``num_new_tokens`` tokens starting at ``num_computed_tokens``:

    flat batch  [ r0: decode | r1: decode | r2: prefill chunk (5 tokens) ]
    positions   [   17       |    3       | 32 33 34 35 36               ]
    slots       [ blk*16+off ...                                          ]
    sampled?    [   yes      |   yes      | only if the chunk ends the prompt ]
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import psutil
import torch

from sluice.engine.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    flat_batch_metadata,
    make_attention_backend,
)
from sluice.engine.config import BLOCK_SIZE, EngineConfig
from sluice.engine.kv_quant import KVCache, resolve_kv_format
from sluice.engine.lora_manager import build_lora_batch
from sluice.engine.protocol import TokenLogprobs
from sluice.engine.sampler import Sampler, SamplingRow
from sluice.engine.scheduler import SchedulerOutput
from sluice.engine.spec_config import SpecMethod, SpeculativeConfig
from sluice.errors import ConfigError, InvalidRequestError
from sluice.kernels import ext
from sluice.kernels.autotune import plan_kernels
from sluice.models.loader import ModelSource, load_model

__all__ = ["ModelRunner", "resolve_dtype", "kv_bytes_per_block"]

log = logging.getLogger("sluice.engine")

_DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, before any engine set it (NOTE(work-pool))
# NOTE(engine-threads): torch's thread count and sluice's work pool are process state, set by each runner
# for its own model (NOTE(work-pool)): one on the pool leaves torch one thread, one on BLAS gives torch
# every thread.  Where several engines share a process (``LLM`` objects side by side, as the benchmarks
# compare them), the last one built would otherwise set them for all: a float model run after a
# quantized one was built ran its BLAS on one thread (16 tok/s for SmolLM2 in fp32, against 27).  A
# runner whose settings the process no longer has puts them back at the start of its step.
_THREADS_SET_BY: list[weakref.ref[Any] | None] = [None]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        # NOTE(cpu-dtype): float32 is the CPU default although bf16 GEMMs are about
        # 2x faster on CPUs with AVX512-BF16 (docs/benchmarks.md): bf16 results
        # depend on the batch a request shares (GEMM blocking changes rounding),
        # which breaks the per-request seed guarantee; fp32 keeps it.
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise InvalidRequestError(f"unsupported dtype {name!r}: use float32 or bfloat16")
    return _DTYPES[name]


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one full-precision block (see ``KVCacheFormat.bytes_per_block`` for every format)."""
    return 2 * num_layers * BLOCK_SIZE * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, seed: int = 0):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        threads = config.num_threads or int(os.environ.get("SLUICE_NUM_THREADS", "0") or 0) or _DEFAULT_THREADS
        torch.set_num_threads(threads)
        t0 = time.monotonic()
        self.model = load_model(
            source,
            self.dtype,
            config.device,
            max_model_len=config.max_model_len,
            quantization=config.quantization,
            quant_fallback=config.quant_fallback,
        )
        self.invariant_floats = self._invariant_floats()
        sources = sorted({pw.source or f"int{pw.bits}" for lin in self.model.linears().values() for pw in lin.packed})
        self.quantization = "+".join(sources) or "none"
        self.max_model_len: int = self.model.max_positions
        cfg = self.model.cfg
        self.model_config = cfg
        log.info("loaded %s in %.1fs", source.path, time.monotonic() - t0)

        self.kv_format = resolve_kv_format(config.kv_cache_dtype, self.dtype)
        budget = config.kv_cache_memory or int(psutil.virtual_memory().available * config.kv_cache_fraction)
        self.window_layers = self._window_layers()
        slots, groups = self._layer_slots()
        self.num_window_groups = len(set(groups.values()))
        per_block = self.kv_format.bytes_per_block(max(slots) + 1, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
        self.num_blocks = max(1, budget // per_block)
        self.kv_cache = KVCache(
            self.kv_format, cfg.num_layers, self.num_blocks, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, self.device,
            layer_slots=slots, window_groups=groups,
        )
        self.kv_cache_bytes = self.kv_cache.num_bytes
        self.attention = make_attention_backend(
            config.attention_backend, config.device, self.kv_cache, cfg.head_dim**-0.5
        )
        self.work_pool_threads = self._use_work_pool(threads)
        self._threads = (torch.get_num_threads(), self.work_pool_threads)  # NOTE(engine-threads)
        _THREADS_SET_BY[0] = weakref.ref(self)
        self.kernel_path = plan_kernels(self.model)  # on the threads it serves on (NOTE(plan-threads))
        self.sampler = Sampler(seed)
        self.lora_adapters: dict[int, Any] | None = None  # lora_id -> LoRAAdapter in memory (LoRAManager.resident)
        self.capture_logits = False  # tests: keep a copy of each step's raw logits
        self._depth = 0  # execute() calls in progress (2 while a step runs nested in another)
        self.last_logits: torch.Tensor | None = None

    def _invariant_floats(self) -> bool:
        """NOTE(float-kernel): a float32 model on the CPU runs its linears on sluice's fixed-order float kernel
        (``csrc/fp32_tile.h``), not BLAS: a row's bits then do not depend on the rows beside it (BLAS rounds a
        decode's one row, a gemv, and a batch's, a gemm, differently), so a float model has the batch
        invariance of the quantized ones: a seeded request gives the same output under any load, and
        speculation's verification the bits of decoding alone (NOTE(spec-invariance)).  It is also the faster
        path here: SmolLM2 in fp32, c=1 1.3x and c=8 1.8x BLAS's tok/s, a 721-token prefill about the same
        (the whole model then runs on the work pool and the fused layer ops; benchmarks/float_kernel.py).
        ``SLUICE_FLOAT_KERNEL=blas`` keeps BLAS.  Not for MoE models (their grouped experts keep their own
        path), bfloat16 or a GPU.  True if any linear moved."""
        want = os.environ.get("SLUICE_FLOAT_KERNEL", "").strip().lower()
        if want not in ("", "kernel", "blas"):
            raise ConfigError(f"SLUICE_FLOAT_KERNEL={want!r}: use kernel (the default) or blas")
        if want == "blas" or self.device.type != "cpu" or self.dtype != torch.float32 or self.model.cfg.num_experts:
            return False
        moved = [lin.make_invariant() for lin in self.model.linears().values()]
        if any(moved):
            self.model.prepare()
            log.info("float32 linears on the batch-invariant float kernel (NOTE(float-kernel))")
        return any(moved)

    def _window_layers(self) -> list[int]:
        """The sliding layers that read block tables of their own (NOTE(hybrid-blocks)): where they are
        interleaved with global layers, unless something copies whole blocks of every layer: a KV disk tier
        (its payload) or a draft model (its cache has a block of every one of its layers per target block)."""
        cfg, config = self.model_config, self.config
        sliding = [i for i in range(cfg.num_layers) if cfg.sliding_window and cfg.is_sliding(i)]
        if not sliding or len(sliding) == cfg.num_layers:
            return []  # no window, or every layer slides: one table, freed as a whole (NOTE(window-blocks))
        why = ("a KV disk tier" if config.kv_disk_dir and config.enable_prefix_caching else
               "a draft model" if config.speculative_config is not None
               and SpeculativeConfig.from_dict(config.speculative_config).method is SpecMethod.DRAFT_MODEL else "")  # fmt: skip
        if why:
            log.info("%s: the sliding layers share the global layers' blocks (none freed)", why)
            return []
        return sliding

    def _layer_slots(self) -> tuple[list[int], dict[int, int]]:
        """Each layer's slot in a block, and each sliding layer's group (NOTE(hybrid-blocks)): a block holds
        as many layers as the model has global ones; the sliding layers fill groups of that many slots."""
        num_layers = self.model_config.num_layers
        if not self.window_layers:
            return list(range(num_layers)), {}
        win = set(self.window_layers)
        width = num_layers - len(win)
        slots, groups = [0] * num_layers, {}
        for j, i in enumerate(i for i in range(num_layers) if i not in win):
            slots[i] = j
        for m, i in enumerate(sorted(win)):
            slots[i], groups[i] = m % width, m // width
        return slots, groups

    def _use_work_pool(self, threads: int) -> int:
        """NOTE(work-pool) (``sluice/kernels/csrc/work_pool.h``): where every layer of the model runs on
        sluice's kernels (quantized or packed float linears, the paged attention), their parallel loops go
        on sluice's work pool, which never waits for a thread the OS has not run, and torch's own ops keep
        one thread (its OpenMP workers would spin beside the pool's between ops).  Elsewhere (BLAS linears,
        torch's attention, a GPU) torch's threads do the work, as before.  ``SLUICE_WORK_POOL=0`` keeps
        torch's OpenMP for the kernels too.  Returns the pool's threads (0: off)."""
        linears = self.model.linears().values()
        own = bool(linears) and all(kind != "dense" for lin in linears for kind, _, _ in lin.parts)
        if (self.device.type != "cpu" or threads < 2 or not own or not isinstance(self.attention, CpuPagedAttention)
                or os.environ.get("SLUICE_WORK_POOL", "1") == "0"):  # fmt: skip
            ext.set_work_pool(0)
            return 0
        ext.set_work_pool(threads)
        torch.set_num_threads(1)
        log.info("kernels' parallel loops on sluice's work pool, %d threads (torch's own ops: 1)", threads)
        return threads

    def _own_threads(self) -> None:
        """Put back this runner's torch threads and work pool where another runner in the process has set
        its own since (NOTE(engine-threads)); a no-op while the process has this runner's."""
        ref = _THREADS_SET_BY[0]
        if ref is not None and ref() is self:
            return
        torch_threads, pool = self._threads
        if ext.work_pool_threads() != pool:
            ext.set_work_pool(pool)
        torch.set_num_threads(torch_threads)
        _THREADS_SET_BY[0] = weakref.ref(self)

    def pool_waits(self) -> ext.PoolWaits:
        """The work pool's waits so far (NOTE(pool-waits) in ``sluice/kernels/csrc/work_pool.h``); zeros while
        this runner's kernels are not on the pool."""
        return ext.work_pool_waits() if self.work_pool_threads else ext.PoolWaits()

    def build_metadata(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        rows: list[tuple[int, int, list[int]]] = []
        sample_idx: list[int] = []
        end = 0  # flat index past the row
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            if s.num_spec:  # speculation: the drafts after its known tokens (NOTE(spec-slots) in the scheduler)
                input_ids.extend(req.token_ids[start : start + n - s.num_spec])
                input_ids.extend(s.spec_token_ids)
            else:
                input_ids.extend(req.token_ids[start : start + n])
            rows.append((start, n, req.block_ids))
            end += n
            if s.samples:  # a drafting decode samples every position from its pending token on
                sample_idx.extend(range(end - 1 - s.num_spec, end))
        window = [[s.request.window_block_ids[q] for s in sched.scheduled] for q in range(self.num_window_groups)]
        positions, meta = flat_batch_metadata(rows, BLOCK_SIZE, self.device, window)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids_t, pos_t, meta, sample_idx

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        rows: list[SamplingRow],
        between_layers: Callable[[int], bool] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Run the step; return the sampled tokens (one per sampling row, in
        scheduled order) and their logprobs.

        ``between_layers(i)`` is called after layer ``i`` (not the last); it may
        run another, nested ``execute`` on other requests (NOTE(mid-step-express)
        in sluice.engine.core) and returns True when it did: this step's
        attention metadata is then set again.  Nothing else of the step lives
        outside this frame between layers (the residual stream is a local).
        """
        # NOTE(denormals): SiLU's exp() underflows through denormals for large |x|;
        # flushing them to zero makes it ~5x faster and changes no logit.  The flag
        # is process state, so it is set only while the model runs (other code in
        # the process, e.g. hypothesis in tests, needs IEEE subnormals); a nested
        # step leaves it to the outer one.
        outer = self._depth == 0
        if outer:
            self._own_threads()
        ftz = outer and self.device.type == "cpu" and torch.set_flush_denormal(True)
        self._depth += 1
        try:
            ids, pos, meta, sample_idx = self.build_metadata(sched)
            self.attention.set_metadata(meta)
            lora = build_lora_batch(sched, self.lora_adapters) if self.lora_adapters else None
            hook = None
            if between_layers is not None:
                def hook(i: int) -> None:
                    if between_layers(i):
                        self.attention.set_metadata(meta)
            hidden = self.model(ids, pos, self.attention, lora, hook)
            if not sample_idx:
                return [], []
            logits = self.model.compute_logits(hidden[sample_idx])  # (N, vocab) fp32
        finally:
            self._depth -= 1
            if ftz:
                torch.set_flush_denormal(False)
        if self.capture_logits:
            self.last_logits = logits.clone()
        return self.sampler(logits, rows)
