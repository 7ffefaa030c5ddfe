"""LoRA adapters on the Llama forward pass: PEFT files -> per-layer deltas, applied per adapter group.

    adapter = load_lora("/adapters/sql", model, max_rank=64, name="sql")   # validated, packed
    batch = LoRABatch([LoRAGroup(0, 7, adapter)], num_rows=9)              # rows 7..8: the base model
    hidden = model(input_ids, positions, attention, lora=batch)

An adapter adds ``s * B @ (A @ x)`` to the output of a target projection
(``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).  PEFT's targets map
onto the fused matrices of ``models/llama.py`` ("seams")::

    x ──rmsnorm──► hs ──qkv──► [q|k|v] ──(+Δqkv)──► rope ──► attention ──► o
    x += o_proj(o) (+Δo)                      Δqkv = Bqkv (Aqkv hs),  Aqkv = [Aq; Ak; Av]
    x ──rmsnorm──► hs ──gate_up──► [g|u] ──(+Δgu)──► silu(g)*u = a            (r_q+r_k+r_v rows)
    x += down(a) (+Δdown)                     Bqkv = ┌ Bq  0   0  ┐  (q+2kv, r_q+r_k+r_v):
                                                     │ 0   Bk  0  │  each target's B (times s)
                                                     └ 0   0   Bv ┘  in its rows, zeros elsewhere

so a layer's deltas are four shrink/expand pairs (``Seam``).  In float32 on
the CPU one seam of a step is one C++ call for every adapter group
(``lora_apply``, sluice/kernels/csrc/lora.cpp), each target's B writing its own
output columns (no zero blocks).  Elsewhere (other dtypes, CUDA, no compiler)
each group runs A then the block matrix B drawn above as two ``Linear`` s.
Either way the expand adds into the base output in place.

NOTE(lora-invariance): the base layers are batch invariant (a row's result
never depends on its neighbours); the deltas keep that.  A and B run a
fixed-order float kernel (each output is an in-order FMA chain over its row,
as in ``make_linear(..., invariant=True)``; not BLAS), each group's rows are
contiguous in the batch, and a delta is added once per row in a fixed order,
so a request's logits are the same bits alone or next to any other adapters.  A batch with adapter rows runs the
layer as the unfused sequence of the same C++ ops the fused calls are made of
(rms_norm, the linear ops, rope_qk, silu_mul), which gives the base rows the
same bits as the fused path; a batch without adapter rows never comes here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sluice.errors import InvalidRequestError
from sluice.kernels import ext
from sluice.kernels import qlinear as ql
from sluice.kernels.linear import KernelPlan, Linear, make_linear, pack_fp32
from sluice.models.llama import AttentionFn, DecoderLayer, LlamaForCausalLM, Rope, apply_rope

if TYPE_CHECKING:
    from sluice.models.config import ModelConfig

__all__ = [
    "PeftConfig",
    "Seam",
    "LayerLoRA",
    "LoRAAdapter",
    "LoRAGroup",
    "LoRABatch",
    "read_peft_config",
    "load_lora",
    "lora_deltas",
    "TARGETS",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (seam, index of the target within the seam)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
SEAMS = ("qkv", "o", "gate_up", "down")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips the adapter name on save)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="lora_path", code="invalid_lora_adapter")


@dataclass(frozen=True)
class PeftConfig:
    """What sluice reads of ``adapter_config.json``."""

    r: int  # nominal rank (each tensor's own rank is read from its shape)
    alpha: float
    target_modules: frozenset[str]  # PEFT names among TARGETS
    use_rslora: bool = False
    base_model: str = ""  # base_model_name_or_path, informative only

    def scaling(self, rank: int) -> float:
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank


def read_peft_config(path: str | Path) -> PeftConfig:
    """Parse and check an adapter's ``adapter_config.json``; ``InvalidRequestError`` naming the problem."""
    p = Path(path)
    if not p.is_dir():
        raise _bad(f"LoRA adapter path {str(p)!r} is not a directory")
    cfg_file = p / CONFIG_FILE
    try:
        doc = json.loads(cfg_file.read_text())
    except OSError:
        raise _bad(f"LoRA adapter {str(p)!r} has no readable {CONFIG_FILE}") from None
    except ValueError as e:
        raise _bad(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _bad(f"{cfg_file}: expected a JSON object")
    peft_type = str(doc.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _bad(f"{cfg_file}: peft_type {peft_type!r} is not supported (only LORA)")
    unsupported = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in unsupported.items():
        if doc.get(key):
            raise _bad(f"{cfg_file}: {what} are not supported")
    if doc.get("bias", "none") not in ("none", None):
        raise _bad(f"{cfg_file}: bias={doc['bias']!r} is not supported (LoRA biases); use bias='none'")
    try:
        r = int(doc["r"])
        alpha = float(doc.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError):
        raise _bad(f"{cfg_file}: 'r' (rank) must be an integer") from None
    if r < 1:
        raise _bad(f"{cfg_file}: rank r={r} must be >= 1")
    targets = doc.get("target_modules") or []
    if isinstance(targets, str):  # PEFT also accepts a regex over module names
        rx = re.compile(targets)
        names = {t for t in TARGETS if any(rx.fullmatch(f"model.layers.0.{g}.{t}") for g in ("self_attn", "mlp"))}
        names |= {t for t in TARGETS if rx.fullmatch(t)}
    else:
        names = {str(t).rsplit(".", 1)[-1] for t in targets}
        unknown = sorted(names - set(TARGETS))
        if unknown:
            raise _bad(
                f"{cfg_file}: target modules {', '.join(unknown)} are not supported "
                f"(sluice applies adapters to {', '.join(TARGETS)})"
            )
    if not names:
        raise _bad(f"{cfg_file}: no target modules among {', '.join(TARGETS)}")
    return PeftConfig(r, alpha, frozenset(names), bool(doc.get("use_rslora", False)),
                      str(doc.get("base_model_name_or_path") or ""))  # fmt: skip


# ---------------------------------------------------------------- weights


@dataclass
class Seam:
    """The delta of one fused matrix: ``out += B (A x)``, A: (R, in), B: (out, R).

    ``op``: the C++ ``LoRASeam`` (float32 on the CPU; run by ``LoRABatch`` for all groups at
    once); else ``a`` and ``b``, two ``Linear`` s run group by group (``add``).
    """

    op: Any = None
    a: Linear | None = None
    b: Linear | None = None
    nbytes: int = 0

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += B (A x), in place; ``x`` (n, in) and ``out`` (n, out) may be row views of the batch."""
        assert self.a is not None and self.b is not None
        self.b(self.a(x), residual=out)


@dataclass
class LayerLoRA:
    seams: dict[str, Seam] = field(default_factory=dict)  # 'qkv' | 'o' | 'gate_up' | 'down' -> its delta

    def get(self, name: str) -> Seam | None:
        return self.seams.get(name)


@dataclass
class LoRAAdapter:
    """One loaded adapter: its deltas per layer, ready for the forward pass."""

    name: str
    path: str
    config: PeftConfig
    rank: int  # the largest rank of its tensors
    layers: list[LayerLoRA]  # one per model layer (empty where the adapter changes nothing)
    digest: str  # blake2b of the config and weight files: the adapter's content identity
    num_file_bytes: int  # bytes read from disk
    num_bytes: int = 0  # bytes held in memory (packed)
    isa: int = -1  # its C++ seams' path: 0 scalar, 1 AVX2, 2 AVX-512 (the model's kernel plan); -1: Linear seams

    @property
    def targets(self) -> list[str]:
        return sorted(self.config.target_modules, key=list(TARGETS).index)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT target on this base model."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def _read_weights(p: Path) -> tuple[dict[str, torch.Tensor], str, int]:
    """The adapter's tensors, the digest of its files and the bytes read."""
    from safetensors.torch import load as st_load

    wfile = p / WEIGHTS_FILE
    if not wfile.is_file():
        if (p / "adapter_model.bin").is_file():
            raise _bad(f"LoRA adapter {str(p)!r}: adapter_model.bin (pickle) is not loaded; save it as {WEIGHTS_FILE}")
        raise _bad(f"LoRA adapter {str(p)!r} has no {WEIGHTS_FILE}")
    try:
        data = wfile.read_bytes()
        cfg_bytes = (p / CONFIG_FILE).read_bytes()
    except OSError as e:
        raise _bad(f"cannot read LoRA adapter {str(p)!r}: {e.strerror or e}") from None
    try:
        tensors = st_load(data)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own types
        raise _bad(f"{wfile}: not a valid safetensors file ({e})") from None
    h = hashlib.blake2b(digest_size=16)
    h.update(cfg_bytes)
    h.update(data)
    return tensors, h.hexdigest(), len(data) + len(cfg_bytes)


def lora_deltas(path: str | Path, cfg: ModelConfig, *, max_rank: int | None = None) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """``(layer, target) -> (A (r, in), B (out, r), scaling)`` in float32, checked against the base model.

    The one reader of the weight file (``load_lora`` packs its result; tests
    merge it into the base weights for a reference).
    """
    p = Path(path)
    pcfg = read_peft_config(p)
    tensors, _, _ = _read_weights(p)
    return _check_tensors(p, pcfg, tensors, cfg, max_rank)[0]


def _check_tensors(
    p: Path, pcfg: PeftConfig, tensors: dict[str, torch.Tensor], cfg: ModelConfig, max_rank: int | None
) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], int]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _bad(f"LoRA adapter {str(p)!r}: tensor {key!r} is not a LoRA A/B weight of "
                       f"{', '.join(TARGETS)} (lm_head, embeddings and extra modules are not supported)")  # fmt: skip
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise _bad(f"LoRA adapter {str(p)!r}: tensor {key!r} targets {target!r}, which sluice does not adapt")
        if layer >= cfg.num_layers:
            raise _bad(f"LoRA adapter {str(p)!r}: tensor {key!r} is for layer {layer}, "
                       f"the base model has {cfg.num_layers} layers (another base model?)")  # fmt: skip
        pairs.setdefault((layer, target), {})[ab] = t
    if not pairs:
        raise _bad(f"LoRA adapter {str(p)!r}: {WEIGHTS_FILE} holds no LoRA weights")
    shapes = _shapes(cfg)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    max_seen = 0
    for (layer, target), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{target}"
        if set(ab) != {"A", "B"}:
            raise _bad(f"LoRA adapter {str(p)!r}: {name} has lora_{''.join(ab)} but not its pair")
        a, b = ab["A"], ab["B"]
        n_out, n_in = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise _bad(
                f"LoRA adapter {str(p)!r} does not fit this base model: {name} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}, the model needs A (r, {n_in}) and B ({n_out}, r) (another base model?)"
            )
        r = int(a.shape[0])
        if max_rank is not None and r > max_rank:
            raise _bad(f"LoRA adapter {str(p)!r}: rank {r} of {name} is above --max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _bad(f"LoRA adapter {str(p)!r}: {name} holds NaN or infinite values")
        max_seen = max(max_seen, r)
        out[(layer, target)] = (a.float(), b.float(), pcfg.scaling(r))
    return out, max_seen


def _kernel_plan(model: LlamaForCausalLM) -> KernelPlan:
    """The model's kernel plan (its quantized linears share one), else the best path of this CPU."""
    for lin in model.linears().values():
        if lin.is_quantized:
            return lin.plan
    import os

    forced = os.environ.get("SLUICE_KERNEL_PATH", "").strip().upper()
    paths = ql.available_paths()
    return KernelPlan(default=ql.Path[forced] if forced in ql.Path.__members__ else paths[0])


def load_lora(path: str | Path, model: LlamaForCausalLM, *, max_rank: int | None = None, name: str = "") -> LoRAAdapter:
    """Read, check and pack a PEFT adapter for ``model``.  Raises ``InvalidRequestError``
    naming the problem (bad path, unsupported config, shapes of another base model,
    rank above ``max_rank``); builds nothing half-way (the caller gets an adapter or an error)."""
    p = Path(path)
    if not all(getattr(layer, "plain", True) for layer in model.layers):
        raise _bad(f"LoRA adapters run on plain Llama-style layers; this {model.cfg.arch} model has architecture options "
                   "(q/k norms, sliding windows, soft-capping, experts ...) the adapter path does not apply")
    pcfg = read_peft_config(p)
    tensors, digest, num_file_bytes = _read_weights(p)
    deltas, rank = _check_tensors(p, pcfg, tensors, model.cfg, max_rank)
    cfg = model.cfg
    dtype = model.dtype
    device = model.rope_cos.device
    # NOTE(lora-kernel): float32 on the CPU runs the C++ seams (one call per seam and step);
    # other dtypes/devices, or no compiler, keep Linears (dense matrices, torch matmul).
    lora_ext = _lora_ext() if dtype == torch.float32 and device.type == "cpu" else None
    plan = _kernel_plan(model) if dtype == torch.float32 and device.type == "cpu" else None
    sizes = {t: s[0] for t, s in _shapes(cfg).items()}
    layers = [LayerLoRA() for _ in range(cfg.num_layers)]
    seam_targets: dict[str, list[str]] = {s: [t for t, (seam, _) in TARGETS.items() if seam == s] for s in SEAMS}
    for li, layer in enumerate(layers):
        for seam, targets in seam_targets.items():
            present = [t for t in targets if (li, t) in deltas]
            if not present:
                continue
            a = torch.cat([deltas[(li, t)][0] for t in present])  # (R, in)
            width = sum(sizes[t] for t in targets)
            parts: list[tuple[torch.Tensor, int, int]] = []  # (s * B_t (n, r), first output column, first A row)
            row, col = 0, 0
            for t in targets:
                if t in present:
                    _, bt, scale = deltas[(li, t)]
                    parts.append((bt * scale, row, col))
                    col += bt.shape[1]
                row += sizes[t]
            if lora_ext is not None:
                layer.seams[seam] = _cpp_seam(lora_ext, a, parts, width)
            else:
                b = torch.zeros(width, a.shape[0])  # (out, R): block "diagonal", zeros where a target is absent
                for bt, r0, c0 in parts:
                    b[r0 : r0 + bt.shape[0], c0 : c0 + bt.shape[1]] = bt
                la, lb = _linear(a, dtype, device, plan), _linear(b, dtype, device, plan)
                layer.seams[seam] = Seam(a=la, b=lb, nbytes=la.nbytes + lb.nbytes)
    adapter = LoRAAdapter(name or p.name, str(p), pcfg, rank, layers, digest, num_file_bytes)
    adapter.num_bytes = sum(s.nbytes for layer in layers for s in layer.seams.values())
    if lora_ext is not None and plan is not None:
        adapter.isa = 0 if plan.default == ql.Path.SCALAR else 2 if plan.default in (ql.Path.AVX512VNNI, ql.Path.AMX) else 1
    return adapter


def _lora_ext() -> Any:
    try:
        return ext.load("lora")
    except Exception:  # noqa: BLE001 -- no compiler: the Linear path serves
        return None


def _cpp_seam(lora_ext: Any, a: torch.Tensor, parts: list[tuple[torch.Tensor, int, int]], width: int) -> Seam:
    a_packed = pack_fp32(a)
    op = lora_ext.LoRASeam(a_packed, a.shape[0], a.shape[1], width)
    nbytes = a_packed.numel() * 4
    for bt, r0, c0 in parts:
        b_packed = pack_fp32(bt)  # (n, r) -> (ceil(n/16), r, 16)
        op.add_part(b_packed, bt.shape[0], bt.shape[1], r0, c0)
        nbytes += b_packed.numel() * 4
    return Seam(op=op, nbytes=nbytes)


def _linear(w: torch.Tensor, dtype: torch.dtype, device: torch.device, plan: KernelPlan | None) -> Linear:
    invariant = plan is not None  # float32 on the CPU: the fixed-order float kernel
    lin = make_linear([w if invariant else w.to(dtype)], invariant=invariant)
    lin.to(device)
    if plan is not None:
        lin.plan = plan
    lin.prepare()
    return lin


# ---------------------------------------------------------------- the batch


@dataclass(frozen=True)
class LoRAGroup:
    start: int  # first row of the flat batch that uses the adapter
    end: int  # one past its last row; rows [start, end) are contiguous
    adapter: LoRAAdapter


class LoRABatch:
    """The adapters of one step: contiguous row groups of the flat batch (base rows are in none).

    ``DecoderLayer.forward`` hands a layer to ``forward_layer`` when a step has
    adapter rows; it runs the layer unfused and adds each group's deltas.
    """

    def __init__(self, groups: list[LoRAGroup]):
        self.groups = groups
        self._ext = _lora_ext() if groups and groups[0].adapter.isa >= 0 else None

    def __bool__(self) -> bool:
        return bool(self.groups)

    def _add(self, idx: int, seam: str, x: torch.Tensor, out: torch.Tensor) -> None:
        used = [(g, s) for g in self.groups if (s := g.adapter.layers[idx].seams.get(seam)) is not None]
        if not used:
            return
        if used[0][1].op is not None:  # one C++ call for every group (NOTE(lora-one-call) in lora.cpp)
            self._ext.lora_apply(x, out, [g.start for g, _ in used], [g.end for g, _ in used],
                                 [s.op for _, s in used], used[0][0].adapter.isa)  # fmt: skip
            return
        for g, s in used:
            s.add(x[g.start : g.end], out[g.start : g.end])

    def forward_layer(
        self, layer: DecoderLayer, idx: int, x: torch.Tensor, rope: Rope, attention: AttentionFn
    ) -> torch.Tensor:
        """``DecoderLayer.forward`` with the deltas: the same ops as its fused calls, in the same order."""
        t = x.shape[0]
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if layer.fused:
            k = layer.ops.fused
            hs = k.rms_norm(x, layer.input_norm, layer.eps)
            qkv = layer.qkv.op.forward(hs)  # (T, q + 2kv)
            self._add(idx, "qkv", hs, qkv)
            k.rope_qk(qkv, rope.positions, rope.cos_table, rope.sin_table, nh, nkv, hd)
            q, kk, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            attn = attention(idx, q.view(t, nh, hd), kk.view(t, nkv, hd), v.view(t, nkv, hd)).reshape(t, layer.q_size)
            layer.o_proj.op.forward(attn, x)  # x += attn @ Wo^T
            self._add(idx, "o", attn, x)
            hs = k.rms_norm(x, layer.post_attn_norm, layer.eps)
            gu = layer.gate_up.op.forward(hs)  # (T, 2I)
            self._add(idx, "gate_up", hs, gu)
            act = k.silu_mul(gu)  # (T, I)
            layer.down.op.forward(act, x)  # x += act @ Wdown^T
            self._add(idx, "down", act, x)
            return x
        ops = layer.ops
        cos, sin = rope.gathered()
        hs = ops.rms_norm(x, layer.input_norm, layer.eps)
        qkv = layer.qkv(hs)
        self._add(idx, "qkv", hs, qkv)
        q, kk, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q = apply_rope(q.view(t, nh, hd), cos, sin)
        kk = apply_rope(kk.view(t, nkv, hd), cos, sin)
        attn = attention(idx, q, kk, v.view(t, nkv, hd)).reshape(t, layer.q_size)
        x = layer.o_proj(attn, residual=x)
        self._add(idx, "o", attn, x)
        hs = ops.rms_norm(x, layer.post_attn_norm, layer.eps)
        gu = layer.gate_up(hs)
        self._add(idx, "gate_up", hs, gu)
        act = ops.silu_mul(gu)
        x = layer.down(act, residual=x)
        self._add(idx, "down", act, x)
        return x


def describe(adapter: LoRAAdapter) -> dict[str, Any]:
    """A JSON-able summary (logs, the load endpoint's answer)."""
    return {"name": adapter.name, "path": adapter.path, "rank": adapter.rank, "alpha": adapter.config.alpha,
            "targets": adapter.targets, "num_bytes": adapter.num_bytes, "digest": adapter.digest}  # fmt: skip
