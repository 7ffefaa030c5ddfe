"""Engine configuration: ``EngineConfig``, the one definition of every engine option.

Each field is a setting (``sluice.settings``): its ``setting(...)`` metadata
holds the help text, and from the field alone come

    the flag          --max-num-seqs             (``sluice serve``, ``sluice generate``)
    the variable      SLUICE_MAX_NUM_SEQS
    the file key      max_num_seqs:              (``sluice serve --config FILE.yaml``)
    the LLM argument  LLM("smollm2", max_num_seqs=8)

To add an engine option, add one field here with ``metadata=setting("help")``
(``choices=`` for a closed set of names, ``parse=`` for a unit-bearing string)
and its range check in ``validate``; nothing else needs to change.  A bad value
raises ``ConfigError`` naming the field; the CLI rewrites it to name the flag.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.spec_config import parse_speculative_config
from sluice.errors import ConfigError
from sluice.settings import setting

__all__ = [
    "EngineConfig",
    "ModelInfo",
    "SchedulingPolicy",
    "ATTENTION_BACKENDS",
    "DTYPES",
    "QUANTIZATIONS",
    "KV_CACHE_DTYPES",
    "parse_bytes",
    "parse_lora_modules",
    "BLOCK_SIZE",
]

BLOCK_SIZE = 16  # tokens per KV block (DESIGN.md)
MID_STEP_POLL_S = 0.002  # between layers, look for arrivals at most this often (NOTE(mid-step-express) in core)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class SchedulingPolicy(str, enum.Enum):
    """Waiting-queue orders (``engine.request_queue``); values match ``--scheduling-policy``."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    WFQ = "wfq"


ATTENTION_BACKENDS = ("torch", "cpu_paged")
# ``models.quant.QUANTIZATION_MODES`` (a test keeps the two lists equal)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "awq", "gptq", "sluice")  # ``engine.attention.make_attention_backend`` names
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp8", "int8")  # ``engine.kv_quant`` formats


def parse_bytes(value: str | int | float) -> int:
    """``2GiB`` -> 2147483648; ``512MB`` -> 512000000; ``1e9`` -> 1000000000."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"invalid byte size {value!r}: expected e.g. 2GiB, 512MB, 1000000")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"byte size must be > 0, got {value!r}")
    return n


def parse_lora_modules(value: object) -> list[str]:
    """``--lora-modules`` entries as ``name=path`` strings, from any of the forms vLLM accepts::

        ["sql=/adapters/sql", "chat=/adapters/chat"]                 flags, SLUICE_LORA_MODULES=a=/x,b=/y
        ['{"name": "sql", "path": "/adapters/sql"}']                  JSON per entry
        {"sql": "/adapters/sql"}  or  [{"name": ..., "path": ...}]     config file
    """
    import json

    items: list[object] = list(value.items()) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except ValueError:
                raise ConfigError(f"lora_modules: {item!r} is not valid JSON", setting="lora_modules") from None
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            raise ConfigError(f"lora_modules: expected name=path, got {item!r}", setting="lora_modules")
        name, path = str(name or "").strip(), str(path or "").strip()
        if not name or not path or any(c.isspace() for c in name):
            raise ConfigError(f"lora_modules: expected name=path with a non-empty name and path, got {item!r}",
                              setting="lora_modules")  # fmt: skip
        out.append(f"{name}={path}")
    return out


@dataclass
class EngineConfig:
    model: str = field(default="smollm2", metadata=setting(
        "HF directory, .gguf file, or the alias 'smollm2'.", flags=["-m"]))
    dtype: str | None = field(default=None, metadata=setting(
        "Weights and activations dtype (default: float32 on CPU, bfloat16 on GPU).", choices=DTYPES))
    device: str = field(default="cpu", metadata=setting("torch device: cpu, cuda, cuda:1, ..."))
    kv_cache_memory: int | None = field(default=None, metadata=setting(
        "KV cache budget for K+V of all layers, e.g. 2GiB (default: --kv-cache-fraction of free memory).",
        parse=parse_bytes))
    kv_cache_fraction: float = field(default=0.05, metadata=setting(
        "Share of free memory for the KV cache when --kv-cache-memory is not given, in (0, 0.9]."))
    max_model_len: int | None = field(default=None, metadata=setting(
        "Context window, prompt + output (default: the model's, capped at 8192)."))
    max_num_batched_tokens: int = field(default=512, metadata=setting(
        "Token budget of one engine step (prefill chunks + decodes)."))
    # NOTE(p0-slots): 128, not 64.  Under overload P0 holds most of the slots (its decodes run in steps that
    # nested express steps stretch), and a P0 with no free slot cannot be nested mid-step: it waits out the
    # running step.  The lower classes' rows stay bounded by the row cap (NOTE(row-cap)), so the extra slots
    # go to P0.  The A/B is in docs/design/overload.md.
    max_num_seqs: int = field(default=128, metadata=setting("Running sequences cap."))
    scheduling_policy: str = field(default="wfq", metadata=setting(
        "Order of the waiting queue: fcfs, strict priority, or weighted fair queuing by class.",
        choices=[p.value for p in SchedulingPolicy]))
    express_steps: bool = field(default=True, metadata=setting(
        "Run a waiting P0 request's prefill in a step of its own, without the running decodes, when that "
        "step is much shorter (P0's time to first token: the rest of the running step plus a short one)."))
    express_mid_step: bool = field(default=True, metadata=setting(
        "Let an express step start between two layers of the running step when a P0 request arrives, "
        "instead of after it (engine core process only)."))
    attention_backend: str | None = field(default=None, metadata=setting(
        "Attention kernel (default: the best available, see `sluice doctor`).", choices=ATTENTION_BACKENDS))
    enable_prefix_caching: bool = field(default=True, metadata=setting(
        "Reuse the KV blocks of shared prompt prefixes."))
    kv_cache_dtype: str = field(default="auto", metadata=setting(
        "KV cache element type: auto (the model dtype), fp32, bf16, or fp8 (e4m3) / int8 with a "
        "scale per token and KV head (about 4x the tokens of fp32 in the same memory).",
        choices=KV_CACHE_DTYPES))
    kv_disk_dir: str | None = field(default=None, metadata=setting(
        "Directory of the disk KV tier: full prefix blocks are written there and loaded instead of "
        "recomputed, also after a restart (default: no disk tier)."))
    kv_disk_size: int = field(default=20 * 1024**3, metadata=setting(
        "Size cap of the disk KV tier, e.g. 20GiB; least recently used files are evicted.",
        parse=parse_bytes))
    num_threads: int | None = field(default=None, metadata=setting(
        "Engine compute threads (default: torch's, one per core): sluice's kernels run them on their own "
        "work pool where the whole model runs on those kernels, else they are torch's intra-op threads."))
    quantization: str = field(default="auto", metadata=setting(
        "Weight format served: auto (what the checkpoint holds: GGUF / AWQ / GPTQ weights as they are, "
        "float checkpoints in float), none (everything dequantized to --dtype), int8 / int4 (quantized at "
        "load, round-to-nearest per group), gguf / awq / gptq / sluice (that checkpoint format, as it is).",
        choices=QUANTIZATIONS))
    quant_fallback: str = field(default="auto", metadata=setting(
        "Layers kept in float when quantizing at load: auto (the most sensitive ones, measured on "
        "calibration text), none, or comma-separated patterns of HF weight names (fnmatch)."))
    lora_modules: list[str] = field(default_factory=list, metadata=setting(
        "LoRA adapters (PEFT directories) served by name: name=path; repeatable, several after one flag, "
        "or JSON {\"name\", \"path\"}. A request's model picks the base model or an adapter.",
        parse=parse_lora_modules, multi_value=True))
    max_lora_rank: int = field(default=64, metadata=setting(
        "Largest LoRA rank accepted; an adapter of a higher rank is refused."))
    max_loras: int = field(default=8, metadata=setting(
        "Distinct LoRA adapters in one engine step; requests of other adapters wait for the next steps."))
    max_cpu_loras: int | None = field(default=None, metadata=setting(
        "LoRA adapters kept loaded in memory, least recently used evicted (default: 2 x --max-loras); "
        "an evicted adapter is reloaded by its next request."))
    jump_forward: bool = field(default=True, metadata=setting(
        "Structured outputs: where a request's grammar admits exactly one continuation, append its tokens at "
        "once and compute them in one step, instead of a decode step each (the tokens are the same)."))
    structured_compile_timeout: float = field(default=30.0, metadata=setting(
        "Structured outputs: seconds a request waits for its grammar to compile before it ends with an error."))
    structured_cache_size: int = field(default=512, metadata=setting(
        "Structured outputs: compiled grammars kept, least recently used evicted."))
    structured_cache_memory: int = field(default=256 * 1024**2, metadata=setting(
        "Structured outputs: memory the compiled grammars kept may take (estimated), e.g. 256MiB.",
        parse=parse_bytes))
    speculative_config: dict[str, Any] | None = field(default=None, metadata=setting(
        "Speculative decoding (docs/speculative.md), JSON with vLLM's names: "
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}, "
        "{\"model\": \"self:q4\", \"num_speculative_tokens\": 4} (the target's own 4-bit copy drafts), or auto; "
        "k adapts to the load unless \"k_policy\": \"fixed\". Greedy and seeded output are unchanged.",
        parse=parse_speculative_config))

    def validate(self) -> None:
        """Range and name checks; ``ConfigError`` naming the field (``.setting``)."""

        def bad(name: str, reason: str) -> ConfigError:
            return ConfigError(f"{name}: {reason}", setting=name)

        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad(name, f"must be >= 1, got {value}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise bad("kv_cache_memory", f"must be > 0, got {self.kv_cache_memory}")
        if not (0.0 < self.kv_cache_fraction <= 0.9):
            raise bad("kv_cache_fraction", f"must be in (0, 0.9], got {self.kv_cache_fraction}")
        if self.dtype not in (None, *DTYPES):
            raise bad("dtype", f"unsupported dtype {self.dtype!r}: use {', '.join(DTYPES)}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise bad("attention_backend",
                      f"unknown backend {self.attention_backend!r}: use {', '.join(ATTENTION_BACKENDS)}")  # fmt: skip
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"unknown quantization {self.quantization!r}: use {', '.join(QUANTIZATIONS)}")
        for name in ("max_lora_rank", "max_loras", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad(name, f"must be >= 1, got {value}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", f"({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras}): "
                      "every adapter of a step is in memory")  # fmt: skip
        adapters = [m.split("=", 1)[0] for m in parse_lora_modules(self.lora_modules)]
        if len(set(adapters)) != len(adapters):
            raise bad("lora_modules", f"adapter names must be unique, got {', '.join(adapters)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"unknown KV cache dtype {self.kv_cache_dtype!r}: use {', '.join(KV_CACHE_DTYPES)}")
        if not (self.structured_compile_timeout > 0.0):
            raise bad("structured_compile_timeout", f"must be > 0, got {self.structured_compile_timeout}")
        for name in ("structured_cache_size", "structured_cache_memory"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.kv_disk_size < 1:
            raise bad("kv_disk_size", f"must be > 0, got {self.kv_disk_size}")
        try:  # LLM(speculative_config={...}) and EngineCore(...) give it unparsed
            self.speculative_config = parse_speculative_config(self.speculative_config)
        except ConfigError as e:
            raise bad("speculative_config", e.message) from None
        if self.scheduling_policy not in {p.value for p in SchedulingPolicy}:
            names = ", ".join(p.value for p in SchedulingPolicy)
            raise bad("scheduling_policy", f"unknown policy {self.scheduling_policy!r}: use {names}")

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """``--lora-modules`` as name -> path."""
        return dict(m.split("=", 1) for m in parse_lora_modules(self.lora_modules))

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in memory (``--max-cpu-loras``, default 2 x ``--max-loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else 2 * self.max_loras


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about the loaded model."""

    name: str  # served model name ('smollm2', directory name, or file stem)
    path: str
    max_model_len: int  # context window enforced by the engine (prompt + output)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    attention_backend: str
    quantization: str = "none"  # what the weights are served as: 'none' or e.g. 'gguf:Q4_1+Q8_0'
    kernel_path: str = ""  # quantized GEMM path picked at start-up ('' when nothing is quantized)
    architecture: str = ""  # the decoder's family: 'llama', 'qwen3', 'gemma3', 'qwen3_moe', ... ('' when unknown)
    num_parameters: int = 0  # weights of the model (every expert of a MoE)
    num_active_parameters: int = 0  # weights one token runs through (MoE: the top-k experts); = num_parameters if dense
    weight_bytes: int = 0  # bytes of the weights as served (packed quantized linears, float norms)
