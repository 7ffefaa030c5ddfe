"""The Llama-family forward pass, written for the paged engine.

One call handles a *flattened* variable-length batch: the prefill chunks and
decode tokens of many sequences are concatenated into ``T`` tokens with no
padding between them.  Attention reads and writes the paged KV cache through an
``AttentionBackend`` (sluice/engine/attention.py) using the metadata the model
runner builds (slot mapping, block tables, query start offsets).

Covers every architecture of ``ModelConfig`` (models/config.py): the Llama
layer (RMSNorm, rotary embeddings in HF's "rotate half" layout, grouped-query
attention, SwiGLU MLP, optionally tied embeddings) plus the options other
architectures add: q/k norms, sandwich norms, GeGLU, scaled embeddings,
soft-capping, sliding-window layers (models/attention.py), partial rotary, and
mixture-of-experts MLPs (models/moe.py).

Weights are fused at load time: q/k/v into one ``qkv`` matrix and gate/up into
one ``gate_up`` matrix, so a layer runs 4 GEMMs over the whole batch.  Every
matrix is a ``sluice.kernels.linear.Linear``: full precision, or group-wise
quantized (GGUF, AWQ/GPTQ, quantized at load) running sluice's int8 kernels.

In float32 on the CPU the elementwise chains (RMSNorm, SiLU x up) run as fused
C++ ops (sluice/kernels/csrc/ops.cpp) and the residual adds happen inside the
GEMMs' epilogues; other dtypes and devices use the torch ops.  The fused
whole-layer ops compute the plain Llama layer only (``ModelConfig.is_plain``);
a layer with any other option runs the same linears through the torch sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import ext
from sluice.kernels.linear import Linear, make_linear
from sluice.kernels.qweight import QuantWeight
from sluice.models import attention as attn_ext
from sluice.models.config import ModelConfig
from sluice.models.moe import MoEBlock
from sluice.models.rope import Rope, apply_rope, rope_tables

__all__ = ["LlamaForCausalLM", "AttentionFn", "LayerDeltas", "WeightValue", "Rope"]

WeightValue = torch.Tensor | QuantWeight


class AttentionFn(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # (T, num_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim), new tokens only
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
    ) -> torch.Tensor:  # (T, num_heads, head_dim)
        ...


class LayerDeltas(Protocol):
    """What runs a decoder layer with per-row weight deltas (``sluice.models.lora.LoRABatch``).

    Named here, not imported, so the model does not depend on the adapters that extend it.
    """

    def forward_layer(
        self, layer: DecoderLayer, idx: int, x: torch.Tensor, rope: Rope, attention: AttentionFn
    ) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE(numerics): normalise in float32 like HF, then scale in the serving dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Ops:
    """The elementwise ops of a layer: fused C++ (float32, CPU) or torch."""

    def __init__(self, fused: Any | None):
        self.fused = fused

    @classmethod
    def for_model(cls, dtype: torch.dtype, device: torch.device | str) -> Ops:
        if dtype == torch.float32 and torch.device(device).type == "cpu":
            try:
                return cls(ext.load("quant"))
            except Exception:  # noqa: BLE001 -- no compiler: the torch ops are the fallback
                return cls(None)
        return cls(None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, weight, eps)  # type: ignore[no-any-return]
        return rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)  # type: ignore[no-any-return]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if act == "silu":
            return self.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # GeGLU (gemma): gelu_pytorch_tanh
        return F.gelu(gate, approximate="tanh") * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, idx: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.ops = Ops(None)
        self.fused = False  # set by LlamaForCausalLM.prepare()
        self.fused_mlp = False  # the MLP alone on the fused C++ op (a layer whose attention is not plain)
        self.plain = cfg.is_plain and not cfg.is_sliding(idx) and not cfg.is_moe(idx)
        self.act = cfg.hidden_act
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.window = cfg.sliding_window if cfg.is_sliding(idx) else None
        self.local_rope = cfg.is_sliding(idx) and cfg.rope_local_theta is not None
        self.softcap = cfg.attn_softcap
        self.scale = cfg.query_scale if cfg.query_scale is not None else d**-0.5

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = p(h)
        self.post_attn_norm = p(h)  # HF post_attention_layernorm: before the MLP, or on the attention output (sandwich)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_ffn_norm = p(h)
            self.post_ffn_norm = p(h)
        if cfg.qk_norm != "none":
            qn, kn = (d, d) if cfg.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = p(qn)
            self.k_norm = p(kn)
        # filled by LlamaForCausalLM.load_weights (their parts depend on the checkpoint)
        self.qkv = Linear(h, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, h)
        self.moe: MoEBlock | None = MoEBlock(cfg) if cfg.is_moe(idx) else None
        if self.moe is None:
            self.gate_up = Linear(h, 2 * cfg.intermediate_size)
            self.down = Linear(cfg.intermediate_size, h)

    def can_fuse(self) -> bool:
        """float32 on the CPU with every linear behind a C++ op: three C++ calls per layer
        (a float model whose linears are plain BLAS matrices keeps the torch path)."""
        return self.plain and self.ops.fused is not None and all(
            lin.op is not None for lin in (self.qkv, self.o_proj, self.gate_up, self.down)
        )

    def can_fuse_mlp(self) -> bool:
        return (self.moe is None and not self.sandwich and self.act == "silu" and self.ops.fused is not None
                and self.gate_up.op is not None and self.down.op is not None)  # fmt: skip

    def forward(
        self,
        idx: int,
        x: torch.Tensor,  # (T, hidden); updated in place (residual adds)
        rope: Rope,
        attention: AttentionFn,
        lora: LayerDeltas | None = None,
    ) -> torch.Tensor:
        if lora:  # adapter rows in the batch: the unfused sequence plus their deltas (models/lora.py)
            return lora.forward_layer(self, idx, x, rope, attention)
        t = x.shape[0]
        if self.fused:
            k = self.ops.fused
            qkv = k.attn_in(x, self.input_norm, self.eps, self.qkv.op, rope.positions, rope.cos_table,
                            rope.sin_table, self.num_heads, self.num_kv_heads, self.head_dim)  # fmt: skip
            attend_qkv = getattr(attention, "attend_qkv", None)
            if attend_qkv is not None:  # the backend slices the heads itself (one call)
                attn = attend_qkv(idx, qkv, self.num_heads)
            else:
                q, kk, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                attn = attention(
                    idx,
                    q.view(t, self.num_heads, self.head_dim),
                    kk.view(t, self.num_kv_heads, self.head_dim),
                    v.view(t, self.num_kv_heads, self.head_dim),
                ).reshape(t, self.q_size)
            self.o_proj.op.forward(attn, x)  # x += attn @ Wo^T
            return k.mlp(x, self.post_attn_norm, self.eps, self.gate_up.op, self.down.op)  # type: ignore[no-any-return]
        if not self.plain:
            return self.forward_options(idx, x, rope, attention)
        ops = self.ops
        cos, sin = rope.gathered()
        hs = ops.rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv(hs)  # (T, q + 2kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn = attention(idx, q, k, v).reshape(t, self.q_size)
        x = self.o_proj(attn, residual=x)  # x += attn @ Wo^T
        hs = ops.rms_norm(x, self.post_attn_norm, self.eps)
        return self.down(ops.silu_mul(self.gate_up(hs)), residual=x)

    def forward_options(self, idx: int, x: torch.Tensor, rope: Rope, attention: AttentionFn) -> torch.Tensor:
        """The layer with its architecture's options (NOTE(arch-options) in models/config.py)."""
        t, ops = x.shape[0], self.ops
        cos, sin = (rope.local if self.local_rope and rope.local is not None else rope).gathered()
        hs = ops.rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv(hs)  # (T, q + 2kv)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "all":  # olmoe: over every head at once
            q, k = ops.rms_norm(q.contiguous(), self.q_norm, self.eps), ops.rms_norm(k.contiguous(), self.k_norm, self.eps)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # qwen3, gemma3: each head's vector
            q = ops.rms_norm(q.reshape(-1, self.head_dim).contiguous(), self.q_norm, self.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim).contiguous(), self.k_norm, self.eps).view_as(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.window is None and self.softcap is None:
            if self.scale != self.head_dim**-0.5:  # the backends scale by head_dim ** -0.5
                q = q * (self.scale * self.head_dim**0.5)
            attn = attention(idx, q, k, v)
        else:
            attn = attn_ext.attend(attention, idx, q, k, v, scale=self.scale, window=self.window, softcap=self.softcap)
        attn = attn.reshape(t, self.q_size)
        if self.sandwich:  # gemma: x += norm(attn @ Wo^T); x += norm(mlp(norm(x)))
            x = x.add_(ops.rms_norm(self.o_proj(attn), self.post_attn_norm, self.eps))
            hs = ops.rms_norm(x, self.pre_ffn_norm, self.eps)
            return x.add_(ops.rms_norm(self.mlp(hs), self.post_ffn_norm, self.eps))
        x = self.o_proj(attn, residual=x)
        if self.moe is None and self.act == "silu" and self.fused_mlp:  # the plain MLP: one C++ call (qwen3, phi3)
            return ops.fused.mlp(x, self.post_attn_norm, self.eps, self.gate_up.op, self.down.op)  # type: ignore[no-any-return]
        hs = ops.rms_norm(x, self.post_attn_norm, self.eps)
        if self.moe is not None:
            return self.moe(hs, lambda gu: ops.act_mul(gu, self.act), residual=x)
        return self.down(ops.act_mul(self.gate_up(hs), self.act), residual=x)

    def mlp(self, hs: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(hs, lambda gu: self.ops.act_mul(gu, self.act))
        return self.down(self.ops.act_mul(self.gate_up(hs), self.act))


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor  # (max_positions, rotary_dim), buffer
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor | None  # gemma3's sliding layers (their own base), else None
    rope_local_sin: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int = 8192):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # the token embedding doubles as the LM head when the model ties them
        self.embed = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.sliding_window and cfg.sliding_window >= max_positions:  # the window never cuts: plain attention
            cfg = replace(cfg, sliding_window=None)
            self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: Linear | None = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.max_positions = max_positions
        self.ops = Ops(None)
        self.build_rope()

    def build_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, e.g. after loading onto a meta-built model."""
        cos, sin = rope_tables(self.cfg, self.max_positions, device)
        self.register_buffer("rope_cos", cos.to(self.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.dtype), persistent=False)
        local = rope_tables(self.cfg, self.max_positions, device, local=True) if self.cfg.rope_local_theta else None
        self.register_buffer("rope_local_cos", None if local is None else local[0].to(self.dtype), persistent=False)
        self.register_buffer("rope_local_sin", None if local is None else local[1].to(self.dtype), persistent=False)

    def set_ops(self, ops: Ops) -> None:
        self.ops = ops
        for layer in self.layers:
            cast(DecoderLayer, layer).ops = ops
        self.prepare()

    def prepare(self) -> None:
        """Build the linears' C++ ops and pick each layer's path (after loading or re-planning)."""
        for lin in self.linears().values():
            lin.prepare()
        for layer in self.layers:
            dl = cast(DecoderLayer, layer)
            dl.fused = dl.can_fuse()
            dl.fused_mlp = dl.can_fuse_mlp()

    def linears(self) -> dict[str, Linear]:
        """Every Linear of the model by module name (``layers.0.qkv``, ``embed``, ...)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear)}

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        e = self.embed
        kind, i, _ = e.parts[0]
        if kind == "dense":
            return F.embedding(input_ids, getattr(e, f"dense_{i}"))
        if kind == "fp32":  # packed (n/16, k, 16): row n is [n // 16, :, n % 16]
            packed = getattr(e, f"f{i}_data")
            return packed[input_ids // 16, :, input_ids % 16]
        from sluice.kernels.qlinear import dequant_rows

        return dequant_rows(e._packed(i), input_ids.cpu()).to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        attention: AttentionFn,
        lora: LayerDeltas | None = None,  # the step's adapter row groups, if any
        between_layers: Callable[[int], object] | None = None,  # called after each layer but the last
    ) -> torch.Tensor:  # (T, hidden), final-normed
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:  # gemma: as HF, the scale rounded to the serving dtype first
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype, device=x.device)
        local = None
        if self.rope_local_cos is not None and self.rope_local_sin is not None:
            local = Rope(positions, self.rope_local_cos, self.rope_local_sin)
        rope = Rope(positions, self.rope_cos, self.rope_sin, local)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(i, x, rope, attention, lora)
            if between_layers is not None and i < last:
                between_layers(i)  # NOTE(mid-step-express) in sluice.engine.core: another step may run here
        return self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, vocab) fp32
        head = self.embed if self.lm_head is None else self.lm_head
        logits = head(hidden).float()
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def summary(self) -> dict[str, Any]:
        """What ``/v1/models`` and ``sluice doctor`` show of the model (the engine's ModelInfo carries it)."""
        c = self.cfg
        return {
            "architecture": c.arch,
            "num_parameters": c.num_parameters(),
            "num_active_parameters": c.num_parameters(active=True),  # per token: top-k experts of MoE layers
            "num_experts": c.num_experts,
            "num_experts_per_token": c.num_experts_per_tok,
            "weight_bytes": self.weight_bytes(),
            "sliding_window": c.sliding_window,
        }

    def weight_bytes(self) -> int:
        """Bytes of every weight as served (packed quantized linears, float norms)."""
        lin = sum(m.nbytes for m in self.linears().values())
        return lin + sum(p.numel() * p.element_size() for p in self.parameters())

    def load_hf_state_dict(self, sd: dict[str, WeightValue]) -> None:
        """Load HF-named weights (``model.layers.0.self_attn.q_proj.weight`` ...), fusing q/k/v and gate/up
        (phi3's checkpoints hold them fused already: ``qkv_proj``, ``gate_up_proj``).

        A linear weight may be a float tensor or a ``QuantWeight``; norms and biases are float tensors.
        A missing tensor or a shape that does not fit raises ``ValueError`` naming the tensor.
        """
        cfg = self.cfg
        missing: list[str] = []

        def take(name: str, required: bool = True) -> WeightValue | None:
            t = sd.get(name)
            if t is None and required:
                missing.append(name)
            return t

        def put(param: torch.Tensor, name: str) -> None:
            value = take(name)
            if value is None:
                return
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"weight {name}: expected a float tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"weight {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            value = value.float()
            if cfg.norm_offset:  # gemma's HF checkpoints store w - 1 (computed in float32, as HF does)
                value = value + 1.0
            param.data.copy_(value.to(self.dtype))

        def dense(v: WeightValue) -> WeightValue:
            return v if isinstance(v, QuantWeight) else v.to(self.dtype)

        # NOTE(invariant-floats): in a quantized model the float layers (fallback
        # layers, a float head) run sluice's fixed-order float kernel, not BLAS, so
        # the whole model is batch invariant.  A float model is loaded with BLAS parts; the engine moves
        # float32 ones onto the same kernel (NOTE(float-kernel) in sluice.engine.model_runner).
        invariant = any(isinstance(v, QuantWeight) for v in sd.values()) and self.dtype == torch.float32

        def parts_of(names: list[str], fused: str | None = None) -> list[WeightValue] | None:
            if fused is not None and fused in sd:
                return [sd[fused]]
            got = [take(n) for n in names]
            return None if any(p is None for p in got) else got  # type: ignore[return-value]

        def linear(target: Linear, names: list[str], bias_names: list[str] | None = None, fused: str | None = None) -> Linear:
            parts = parts_of(names, fused)
            if parts is None:
                return target
            expect = (target.out_features, target.in_features)
            got = (sum(int(p.shape[0]) for p in parts), int(parts[0].shape[1]))
            if got != expect:
                raise ValueError(f"weight {fused if fused in sd else names[0]}: shape {got}, expected {expect}")
            bias = None
            if bias_names:
                bs = [take(n) for n in bias_names]
                if all(isinstance(b, torch.Tensor) for b in bs):
                    bias = torch.cat(bs)  # type: ignore[arg-type]
            return make_linear([dense(p) for p in parts], bias, invariant=invariant)

        self.embed = linear(self.embed, ["model.embed_tokens.weight"])
        put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            head_name = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
            # some checkpoints tie without saying so
            self.lm_head = linear(self.lm_head, [head_name])
        for i, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            pre = f"model.layers.{i}."
            put(layer.input_norm, pre + "input_layernorm.weight")
            put(layer.post_attn_norm, pre + "post_attention_layernorm.weight")
            if layer.sandwich:
                put(layer.pre_ffn_norm, pre + "pre_feedforward_layernorm.weight")
                put(layer.post_ffn_norm, pre + "post_feedforward_layernorm.weight")
            if layer.qk_norm != "none":
                put(layer.q_norm, pre + "self_attn.q_norm.weight")
                put(layer.k_norm, pre + "self_attn.k_norm.weight")
            qkv_bias = [pre + f"self_attn.{n}_proj.bias" for n in "qkv"] if cfg.attention_bias else None
            layer.qkv = linear(layer.qkv, [pre + f"self_attn.{n}_proj.weight" for n in "qkv"], qkv_bias,
                               fused=pre + "self_attn.qkv_proj.weight")  # fmt: skip
            layer.o_proj = linear(layer.o_proj, [pre + "self_attn.o_proj.weight"])
            if layer.moe is not None:
                self._load_moe(layer.moe, pre + "mlp.", take, invariant, dense)
                continue
            layer.gate_up = linear(layer.gate_up, [pre + f"mlp.{n}_proj.weight" for n in ("gate", "up")],
                                   fused=pre + "mlp.gate_up_proj.weight")  # fmt: skip
            layer.down = linear(layer.down, [pre + "mlp.down_proj.weight"])
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"missing weights: {shown}")
        for module in self.layers:  # new linears have no C++ op until prepare(): no fused call may use theirs
            layer = cast(DecoderLayer, module)
            layer.fused = layer.fused and layer.can_fuse()
            layer.fused_mlp = layer.fused_mlp and layer.can_fuse_mlp()

    def _load_moe(self, moe: MoEBlock, pre: str, take: Callable[..., Any], invariant: bool, dense: Callable[..., Any]) -> None:
        cfg = self.cfg
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        router = take(pre + "gate.weight")
        experts = []
        for e in range(cfg.num_experts):
            ws = [take(f"{pre}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")]
            if any(w is None for w in ws):
                continue
            for w, shape, n in zip(ws, ((inter, h), (inter, h), (h, inter)), ("gate", "up", "down")):
                if tuple(w.shape) != shape:
                    raise ValueError(f"weight {pre}experts.{e}.{n}_proj.weight: shape {tuple(w.shape)}, expected {shape}")
            experts.append(tuple(dense(w) for w in ws))
        if router is None or len(experts) != cfg.num_experts:
            return  # reported as missing
        if tuple(router.shape) != (cfg.num_experts, h):
            raise ValueError(f"weight {pre}gate.weight: shape {tuple(router.shape)}, expected {(cfg.num_experts, h)}")
        moe.load(dense(router), experts, invariant)

    # ---------------------------------------------------------------- converted-weights cache

    def manifest(self) -> dict[str, dict[str, Any]]:
        """Structure of every Linear (parts and their quantization), to rebuild the model from cached tensors."""
        return {name: lin.manifest() for name, lin in self.linears().items()}

    def apply_manifest(self, manifest: dict[str, dict[str, Any]]) -> None:
        """Give every Linear the parts of ``manifest`` with empty (meta) tensors, ready for
        ``load_state_dict(..., assign=True)``."""
        for name, info in manifest.items():
            old = self.get_submodule(name)
            if not isinstance(old, Linear):
                raise ValueError(f"manifest names {name!r}, which is not a linear layer")
            lin = Linear.from_manifest(old.in_features, old.out_features, info, self.dtype)
            parent_name, _, attr = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            setattr(parent, attr, lin)

    def extra_repr(self) -> str:
        c: Any = self.cfg
        return f"arch={c.arch}, layers={c.num_layers}, hidden={c.hidden_size}, heads={c.num_heads}/{c.num_kv_heads}"
