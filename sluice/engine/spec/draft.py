"""The draft model: a second model in the same engine core, with its own paged KV cache.

    target KV cache   [num_blocks, 16, Hkv,  D ]   per layer      one block table per request,
    draft  KV cache   [num_blocks, 16, Hkv', D']   per layer      used by both caches

NOTE(draft-blocks): the draft's cache has as many blocks as the target's and a
request's block ids index both, so the block manager's allocation serves the
draft too, and freeing the request frees its draft K/V with it: no second
allocator, no second table.  A shared prefix block holds the draft K/V of the
request that computed it, which is the same for every request (same tokens,
same weights, batch-invariant kernels).

What the draft has computed is its own progress (``DraftState.num_computed``):
each step it catches up on the tokens the target accepted since its last
step (the whole prompt the first time: drafting starts with a draft prefill),
then drafts one token per step of its own.  Its drafts past what the target
accepts are overwritten the next time, like the target's rejected K/V.

``self:q4`` loads the target's checkpoint again as 4-bit weights: a GGUF's own
quantized weights, or a float checkpoint quantized to int4 at load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.engine.attention import flat_batch_metadata, make_attention_backend
from sluice.engine.config import BLOCK_SIZE, EngineConfig
from sluice.engine.kv_quant import KVCache, resolve_kv_format
from sluice.engine.step_model import StepTimeModel
from sluice.errors import ConfigError
from sluice.models.loader import ModelSource, load_model, resolve_model

__all__ = ["DraftModel", "DraftRow", "draft_source"]

log = logging.getLogger("sluice.engine")


SELF_Q4_MAX_BITS = 5.5  # a GGUF whose layers take more bits per weight than this drafts with int4 (NOTE(self-q4-bits))


def gguf_layer_bits(path: Path) -> float | None:
    """Bits per weight of a GGUF's decoder-layer matrices (its first 2-D ``blk.*`` weight); None if it has none."""
    import gguf

    from sluice.models.files import gguf_reader

    for t in gguf_reader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) >= 2:
            block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            return 8.0 * size / block
    return None


def draft_source(model: str, target: ModelSource) -> tuple[ModelSource, str]:
    """(source, quantization) of the draft model named by the config's ``model``.

    NOTE(self-q4-bits): ``self:q4`` drafts with the GGUF's own weights only where they are 4-bit-class
    (Q4_0, Q4_1, Q4_K, Q5_x: at most ``SELF_Q4_MAX_BITS`` a weight).  A Q8_0 (or F16) file's own weights
    are the target's: such a draft costs a whole target step per token and is always accepted, a loss
    (0.88x on the Llama-1B Q8_0 shape, docs/speculative.md); its draft is quantized to int4 at load instead.
    """
    from sluice.engine.spec_config import SELF_Q4

    if model == SELF_Q4:
        if target.kind != "gguf":
            return target, "int4"
        bits = gguf_layer_bits(target.path)
        return target, "gguf" if bits is not None and bits <= SELF_Q4_MAX_BITS else "int4"
    try:
        return resolve_model(model), "auto"
    except Exception as e:  # noqa: BLE001 -- whatever the loader says, one line naming the setting
        raise ConfigError(f"speculative_config: draft model {model!r}: {e}", setting="speculative_config") from None


@dataclass
class DraftRow:
    """One request's draft work this step."""

    token_ids: Sequence[int]  # its tokens (prompt + output)
    num_computed: int  # tokens the draft has K/V for (< len(token_ids))
    block_ids: Sequence[int]  # its block table (blocks for every position the draft writes)
    num_drafts: int  # tokens to draft (>= 1)


class DraftModel:
    """Loads the draft model and runs its steps; makes no policy decision (the proposer does)."""

    def __init__(self, config: EngineConfig, source: ModelSource, quantization: str, num_blocks: int,
                 dtype: torch.dtype, vocab_size: int):  # fmt: skip
        from sluice.kernels.autotune import plan_kernels

        t0 = time.monotonic()
        self.device = torch.device(config.device)
        # NOTE(draft-head): an int4-at-load draft quantizes its LM head (a tied embedding) too: a float32 head is
        # read whole for every drafted token, as many bytes as the int4 layers of a 1B model; the target checks
        # every draft, so the head's rounding costs acceptance, never an answer
        self.model = load_model(source, dtype, config.device, max_model_len=config.max_model_len,
                                quantization=quantization, quant_fallback="none",
                                quantize_head=True if quantization == "int4" else None)  # fmt: skip
        plan_kernels(self.model)
        cfg = self.model.cfg
        if cfg.vocab_size != vocab_size:
            raise ConfigError(f"speculative_config: the draft model's vocabulary ({cfg.vocab_size}) is not the "
                              f"target's ({vocab_size}): they must share a tokenizer", setting="speculative_config")  # fmt: skip
        self.kv_format = resolve_kv_format(config.kv_cache_dtype, dtype)
        self.kv_cache = KVCache(self.kv_format, cfg.num_layers, num_blocks, cfg.num_kv_heads, cfg.head_dim,
                                BLOCK_SIZE, self.device)  # fmt: skip
        self.attention = make_attention_backend(config.attention_backend, config.device, self.kv_cache, cfg.head_dim**-0.5)
        self.step_model = StepTimeModel()  # the draft's own steps (the adaptive policy's draft cost)
        self.num_steps = 0
        log.info("draft model %s (%s) loaded in %.1fs, KV cache %.1f MiB", source.path, quantization,
                 time.monotonic() - t0, self.kv_cache.num_bytes / 2**20)  # fmt: skip

    @torch.inference_mode()
    def forward(self, rows: Sequence[tuple[Sequence[int], int, int, Sequence[int]]]) -> torch.Tensor:
        """One draft step: for each row (token_ids, start, num_new, block_ids) compute tokens
        ``token_ids[start : start + num_new]``; returns the logits of each row's last one: (rows, vocab)."""
        ids: list[int] = []
        for tokens, start, n, _ in rows:
            ids.extend(tokens[start : start + n])
        # each row attends only the blocks its context fills (its table may hold the target's draft blocks too)
        positions, meta = flat_batch_metadata(
            [(start, n, blocks[: -(-(start + n) // BLOCK_SIZE)]) for _, start, n, blocks in rows], BLOCK_SIZE, self.device)
        qsl = meta.query_start_loc
        dev = self.device
        t0 = time.monotonic()
        ftz = self.device.type == "cpu" and torch.set_flush_denormal(True)  # NOTE(denormals) in model_runner
        try:
            self.attention.set_metadata(meta)
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                                torch.tensor(positions, dtype=torch.long, device=dev), self.attention)  # fmt: skip
            logits = self.model.compute_logits(hidden[[q - 1 for q in qsl[1:]]]).float()  # (rows, vocab)
        finally:
            if ftz:
                torch.set_flush_denormal(False)
        self.step_model.observe(len(ids), time.monotonic() - t0, len(rows))
        self.num_steps += 1
        return logits

    def cost(self, depth: int, num_rows: int) -> float:
        """Seconds of the draft step at ``depth`` for ``num_rows`` rows (the adaptive policy's draft cost)."""
        del depth
        m = self.step_model
        return 0.0 if num_rows <= 0 else m.base + (m.per_token + m.per_seq) * num_rows
