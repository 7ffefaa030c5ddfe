"""Build the engine's KV tier from its settings, and the fingerprint that keys it.

NOTE(fingerprint-fields): the fingerprint must change with everything that
changes a block's bytes, and with nothing else.  Too little, and a restart
with another model or dtype loads wrong K/V; too much, and a restart with a
new ``--max-num-seqs`` finds nothing (a hit rate of 0 after a restart is the
failure this tier exists to avoid).  So it names the model by the content of
its files, the compute dtype and device type, the KV format and shapes, the
payload layout, and every ``EngineConfig`` field except those listed in
``_NO_EFFECT_ON_KV`` (scheduling, memory, threads, paths).  A new setting is
part of the fingerprint until someone lists it here: unknown means unsafe.
The attention backend is listed: backends differ in rounding only, as batch
composition does.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.kv_quant import PAYLOAD_LAYOUT
from sluice.engine.kv_tiers.disk import DiskKVTier
from sluice.engine.kv_tiers.keys import kv_fingerprint
from sluice.models.loader import file_digest

if TYPE_CHECKING:
    from sluice.engine.config import EngineConfig
    from sluice.engine.model_runner import ModelRunner
    from sluice.models.loader import ModelSource

__all__ = ["make_kv_tier", "engine_fingerprint"]

log = logging.getLogger("sluice.engine.kv_tiers")

_NO_EFFECT_ON_KV = {
    "model",  # named by content below
    "device",  # named by device type below
    "dtype",  # named by the resolved dtype below
    "kv_cache_dtype",  # named by the resolved format below
    "kv_cache_memory", "kv_cache_fraction", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
    "scheduling_policy", "attention_backend", "enable_prefix_caching", "kv_disk_dir", "kv_disk_size",
    "num_threads",
}


def model_digest(source: ModelSource) -> str:
    """Content digest of the model's files (memoised by ``file_digest``)."""
    path = Path(source.path)
    if path.is_file():
        return file_digest(path)
    files = sorted([*path.glob("*.safetensors"), *path.glob("*.bin"), path / "config.json"])
    return ",".join(f"{f.name}:{file_digest(f)}" for f in files if f.is_file())


def engine_fingerprint(config: EngineConfig, source: ModelSource, runner: ModelRunner) -> bytes:
    cfg = runner.model_config
    others: dict[str, Any] = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in _NO_EFFECT_ON_KV
    }
    return kv_fingerprint(
        layout=PAYLOAD_LAYOUT,
        model=model_digest(source),
        dtype=str(runner.dtype),
        device_type=runner.device.type,
        kv_dtype=runner.kv_format.name,
        block_size=runner.kv_cache.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        config=others,
    )


def make_kv_tier(config: EngineConfig, source: ModelSource, runner: ModelRunner) -> DiskKVTier | None:
    """The disk tier of ``--kv-disk-dir``, or None (no directory, or prefix caching off)."""
    if not config.kv_disk_dir:
        return None
    if not config.enable_prefix_caching:
        log.warning("--kv-disk-dir is ignored: the disk tier stores prefix-cache blocks and prefix caching is off")
        return None
    fp = engine_fingerprint(config, source, runner)
    return DiskKVTier(config.kv_disk_dir, fp, runner.kv_cache.bytes_per_block, config.kv_disk_size)
