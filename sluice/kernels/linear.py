"""Linear layers behind one interface: full precision or group-wise quantized.

    lin = make_linear([w_q, w_k, w_v], bias)    # each part: a float tensor or a QuantWeight
    y = lin(x)                                   # (T, in) -> (T, out), float32
    lin(x, residual=h)                           # h + x @ W^T, written in place into h

A layer made of several parts (q/k/v, gate/up) that are all quantized the same
way is packed as one matrix (one kernel call); otherwise each part keeps its own
form and writes its own columns of the output (e.g. a GGUF Q4_K_M whose v rows
are Q6_K, or a layer kept in float by the fallback policy).

Quantized parts run sluice's int8-activation kernels (sluice/kernels/qlinear.py)
on the path a ``KernelPlan`` picks per batch size.  Every path gives the same
bits, so the plan may pick per batch size without a request's result ever
depending on its batch (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import qlinear as ql
from sluice.kernels.qweight import QuantWeight

__all__ = ["Linear", "KernelPlan", "make_linear", "concat_qweights"]

# NOTE(batch-buckets): batch sizes at which the fastest kernel path may change;
# a plan maps each bucket to a path (measured by sluice/kernels/autotune.py).
BUCKETS = (1, 4, 8, 16, 64, (1 << 62))  # NOTE(bucket-8) in autotune.py


@dataclass
class KernelPlan:
    """Which kernel path each (shape, batch bucket) uses.  Shared by all linears of a model."""

    default: ql.Path = ql.Path.SCALAR
    by_shape: dict[tuple[int, int, int], list[ql.Path]] = field(default_factory=dict)  # (n, k, mode) -> per bucket

    def paths_for(self, n: int, k: int, mode: int) -> list[ql.Path]:
        """The path of each batch bucket (``BUCKETS``) for one shape."""
        return self.by_shape.get((n, k, mode), [self.default] * len(BUCKETS))

    def path(self, n: int, k: int, mode: int, m: int) -> ql.Path:
        paths = self.paths_for(n, k, mode)
        for i, top in enumerate(BUCKETS):
            if m <= top:
                return paths[i]
        return paths[-1]


def concat_qweights(parts: list[QuantWeight]) -> QuantWeight | None:
    """Stack the rows of compatible quantized parts into one matrix (None if they differ in form)."""
    first = parts[0]
    if any(
        (p.bits, p.group_size, p.zero_point, p.shape[1]) != (first.bits, first.group_size, first.zero_point, first.shape[1])
        for p in parts
    ):
        return None
    if len(parts) == 1:
        return first
    return QuantWeight(
        q=torch.cat([p.q for p in parts]),
        d=torch.cat([p.d for p in parts]),
        m=torch.cat([p.m for p in parts]),
        bits=first.bits,
        group_size=first.group_size,
        zero_point=first.zero_point,
        source=first.source,
    )


def pack_fp32(w: torch.Tensor) -> torch.Tensor:
    """(n, k) float -> (ceil(n/16), k, 16) float32: the batch-invariant dense layout (qgemm.cpp)."""
    n, k = w.shape
    nt = -(-n // ql.TILE)
    w = w.float()
    if nt * ql.TILE != n:
        w = torch.cat([w, w.new_zeros(nt * ql.TILE - n, k)])
    return w.view(nt, ql.TILE, k).transpose(1, 2).contiguous()


def unpack_fp32(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``pack_fp32``: (n, k) float32 (exact)."""
    nt, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(nt * ql.TILE, k)[:n]


class Linear(nn.Module):
    """y = x @ W^T (+ bias) (+ residual, in place), W split by output rows into parts.

    Each part is one of
      ``dense``  a float weight ``dense_<i>`` (n_i, k), run by BLAS (fastest; the
                 model's full-precision path);
      ``fp32``   a float32 weight packed ``f<i>_data`` (ceil(n_i/16), k, 16), run by
                 sluice's batch-invariant float kernel (float layers of a quantized model);
      ``quant``  a packed quantized weight (``q<i>_data``, ``q<i>_scale``, ``q<i>_mins`` + meta).
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.parts: list[tuple[str, int, int]] = []  # (kind 'dense'|'quant', index, n)
        self.packed: list[ql.PackedWeight] = []
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None)
        self.plan = KernelPlan()
        self.op: Any = None  # the C++ QLinearOp once prepare() ran

    # ---------------------------------------------------------------- building

    def add_dense(self, w: torch.Tensor) -> None:
        i = len(self.parts)
        self.register_buffer(f"dense_{i}", w.contiguous(), persistent=True)
        self.parts.append(("dense", i, int(w.shape[0])))

    def add_fp32(self, w: torch.Tensor) -> None:
        """A float part for the batch-invariant kernel: (n, k), or already packed (then fix n after)."""
        i = len(self.parts)
        self.register_buffer(f"f{i}_data", w if w.dim() == 3 else pack_fp32(w), persistent=True)
        self.parts.append(("fp32", i, int(w.shape[0]) if w.dim() == 2 else -1))

    def dense_weight(self, i: int) -> torch.Tensor:
        """Part ``i`` as a plain (n, k) float tensor (unpacked for ``fp32`` parts)."""
        kind, _, n = self.parts[i]
        if kind == "dense":
            return cast(torch.Tensor, getattr(self, f"dense_{i}"))
        if kind == "fp32":
            return unpack_fp32(getattr(self, f"f{i}_data"), n)
        pw = self._packed(i)
        return ql.dequant_rows(pw, torch.arange(pw.n))

    def add_quant(self, pw: ql.PackedWeight) -> None:
        i = len(self.parts)
        for name, t in pw.tensors().items():
            self.register_buffer(f"q{i}_{name}", t, persistent=True)
        self.packed.append(pw)
        self.parts.append(("quant", i, pw.n))

    def set_bias(self, b: torch.Tensor | None) -> None:
        if b is None:
            self.bias = None
            return
        dense_only = bool(self.parts) and all(kind == "dense" for kind, _, _ in self.parts)
        dtype = self.dense_0.dtype if dense_only and self.parts else torch.float32
        self.register_buffer("bias", b.to(dtype).contiguous(), persistent=True)

    def make_invariant(self) -> bool:
        """Move the float32 ``dense`` parts (BLAS) onto the batch-invariant float kernel (``fp32`` parts), in
        place; True if any moved.  Parts in another dtype or off the CPU stay (the kernel is float32, CPU)."""
        moved = False
        parts: list[tuple[str, int, int]] = []
        for kind, i, n in self.parts:
            w = getattr(self, f"dense_{i}") if kind == "dense" else None
            if w is None or w.dtype != torch.float32 or w.device.type != "cpu":
                parts.append((kind, i, n))
                continue
            del self._buffers[f"dense_{i}"]
            self.register_buffer(f"f{i}_data", pack_fp32(w), persistent=True)
            parts.append(("fp32", i, n))
            moved = True
        self.parts = parts
        self.op = None  # prepare() builds it again
        return moved

    def finish(self) -> None:
        n = sum(p[2] for p in self.parts)
        if n != self.out_features:
            raise ValueError(f"linear parts give {n} output features, expected {self.out_features}")

    @property
    def is_quantized(self) -> bool:
        return any(kind == "quant" for kind, _, _ in self.parts)

    @property
    def needs_op(self) -> bool:
        """Parts that only the C++ op runs at full speed (quantized or invariant float)."""
        return any(kind != "dense" for kind, _, _ in self.parts)

    @property
    def nbytes(self) -> int:
        total = 0
        for kind, i, _ in self.parts:
            if kind == "quant":
                total += self._packed(i).nbytes
            else:
                t = getattr(self, f"dense_{i}" if kind == "dense" else f"f{i}_data")
                total += t.numel() * t.element_size()
        return total

    def manifest(self) -> dict[str, Any]:
        """Structure of the parts (and whether there is a bias), to rebuild the module from cached tensors."""
        parts: list[dict[str, Any]] = []
        for kind, i, n in self.parts:
            if kind in ("dense", "fp32"):
                parts.append({"kind": kind, "n": n})
            else:
                pw = self._packed(i)
                parts.append({"kind": kind, "scale_dtype": str(pw.scale.dtype).removeprefix("torch."), **pw.meta()})
        return {"parts": parts, "bias": self.bias is not None}

    @classmethod
    def from_manifest(cls, in_features: int, out_features: int, manifest: dict[str, Any], dtype: torch.dtype) -> Linear:
        """An empty (meta-tensor) Linear with the manifest's parts, for ``load_state_dict(assign=True)``."""
        meta = torch.device("meta")
        lin = cls(in_features, out_features)
        for part in manifest["parts"]:
            if part["kind"] == "dense":
                lin.add_dense(torch.empty(part["n"], in_features, device=meta, dtype=dtype))
            elif part["kind"] == "fp32":
                nt = -(-part["n"] // ql.TILE)
                lin.add_fp32(torch.empty(nt, in_features, ql.TILE, device=meta))
                lin.parts[-1] = ("fp32", lin.parts[-1][1], part["n"])
            else:
                info = {k: v for k, v in part.items() if k not in ("kind", "scale_dtype")}
                nt, kb, ng = -(-info["n"] // ql.TILE), info["k"] // ql.BLOCK, info["k"] // info["group_size"]
                nbytes = nt * kb * (256 if info["mode"] == ql.MODE_W4 else 512)
                sdt = getattr(torch, part["scale_dtype"])
                tensors = {
                    "data": torch.empty(nbytes, dtype=torch.uint8, device=meta),
                    "scale": torch.empty(nt, ng, ql.TILE, dtype=sdt, device=meta),
                    "mins": torch.empty(nt, ng, ql.TILE, dtype=sdt, device=meta),
                }
                lin.add_quant(ql.PackedWeight.from_parts(tensors, info))
        if manifest["bias"]:
            lin.bias = torch.empty(out_features, device=meta)
        lin.finish()
        return lin

    def _packed(self, i: int) -> ql.PackedWeight:
        j = sum(1 for kind, idx, _ in self.parts if kind == "quant" and idx < i)
        pw = self.packed[j]
        # buffers may have been replaced (load_state_dict(assign=True), .to()): read them back
        pw.data, pw.scale, pw.mins = (getattr(self, f"q{i}_{s}") for s in ("data", "scale", "mins"))
        return pw

    # ---------------------------------------------------------------- forward

    def prepare(self) -> None:
        """Build the C++ op over the current buffers (after loading, moving, or a new plan).

        float32 on the CPU with the kernel extension: one C++ call per forward.
        Anything else (bf16, CUDA, no compiler) keeps the Python path.
        """
        self.op = None
        names = {"dense": "dense_{}", "fp32": "f{}_data", "quant": "q{}_data"}
        tensors = [getattr(self, names[kind].format(i)) for kind, i, _ in self.parts]
        if not tensors or any(t.device.type != "cpu" or t.is_meta for t in tensors):
            return
        if any(kind == "dense" and getattr(self, f"dense_{i}").dtype != torch.float32 for kind, i, _ in self.parts):
            return
        if not self.needs_op and self.bias is None and len(self.parts) == 1:
            return  # one dense matrix: F.linear is already a single call
        try:
            mod = ql.kernel_module()
        except Exception:  # noqa: BLE001 -- no kernels: the Python path serves
            return
        op = mod.QLinearOp(self.in_features, self.out_features)
        for j, (kind, i, n) in enumerate(self.parts):
            if kind == "dense":
                op.add_dense(getattr(self, f"dense_{i}"), n)
            elif kind == "fp32":
                op.add_dense(getattr(self, f"f{i}_data"), n)
                op.set_paths(j, [BUCKETS[-1]], [int(self.plan.default)])
            else:
                pw = self._packed(i)
                op.add_quant(pw.data, pw.scale, pw.mins, pw.n, pw.group_size, pw.mode)
                paths = self.plan.paths_for(pw.n, pw.k, pw.mode)
                op.set_paths(j, list(BUCKETS[: len(paths)]), [int(p) for p in paths])
        op.set_bias(None if self.bias is None else self.bias.float())
        self.op = op

    def quant_kernel_args(self) -> tuple[ql.PackedWeight, list[int], list[int]] | None:
        """The layer as one quantized matrix, for a C++ op that runs it among others (models/moe.py's
        grouped experts): its packed weight, and the batch buckets' tops and kernel paths of its plan.
        None unless the layer is exactly that (one quantized part, no bias) and its op was built."""
        if self.op is None or self.bias is not None or len(self.parts) != 1 or self.parts[0][0] != "quant":
            return None
        pw = self._packed(self.parts[0][1])
        paths = self.plan.paths_for(pw.n, pw.k, pw.mode)
        return pw, list(BUCKETS[: len(paths)]), [int(p) for p in paths]

    def fp32_kernel_weight(self) -> torch.Tensor | None:
        """The layer's one batch-invariant float32 matrix, packed (ceil(n/16), k, 16), for a C++ op that
        runs it itself (the MoE router); None unless the layer is exactly that (no bias) and its op was built."""
        if self.op is None or self.bias is not None or len(self.parts) != 1 or self.parts[0][0] != "fp32":
            return None
        return cast(torch.Tensor, getattr(self, f"f{self.parts[0][1]}_data"))

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        out = super()._apply(fn, recurse)
        if self.op is not None:  # the op holds the old tensors
            self.prepare()
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out); with ``residual`` (T, out): returns residual + x @ W^T, written into it."""
        op = self.op
        if op is not None and x.dtype == torch.float32:
            x = x if x.stride(-1) == 1 else x.contiguous()
            if residual is not None and residual.dtype == torch.float32 and residual.stride(-1) == 1:
                return op.forward(x, residual)  # type: ignore[no-any-return]
            y = op.forward(x)
            return y if residual is None else residual.add_(y)
        if len(self.parts) == 1 and self.parts[0][0] == "dense":  # full precision, serving dtype
            y = F.linear(x, self.dense_0, self.bias)
            return y if residual is None else residual.add_(y)
        in_dtype = x.dtype
        x = x.float().contiguous()
        t = x.shape[0]
        if residual is not None and residual.dtype == torch.float32 and residual.is_contiguous():
            out = residual
        else:
            out = torch.empty(t, self.out_features, dtype=torch.float32)
        xq: ql.ActQ | None = None
        col = 0
        bias = self.bias
        for kind, i, n in self.parts:
            b = None if bias is None else bias[col : col + n]
            res = out if out is residual else None
            if kind == "quant":
                pw = self._packed(i)
                path = self.plan.path(pw.n, pw.k, pw.mode, t)
                if xq is None:
                    xq = ql.quantize_activations(x, path)
                ql.gemm(xq, pw, out, col, b, res, path)
            else:
                y = F.linear(x, self.dense_weight(i).float(), b)
                if res is not None:
                    out[:, col : col + n] += y
                else:
                    out[:, col : col + n] = y
            col += n
        if residual is not None and out is not residual:
            residual.add_(out.to(residual.dtype))
            return residual
        return out if in_dtype == torch.float32 else out.to(in_dtype)

    def extra_repr(self) -> str:
        kinds = ",".join(
            kind if kind != "quant" else f"q{self._packed(i).bits}g{self._packed(i).group_size}"
            for kind, i, _ in self.parts
        )
        return f"in={self.in_features}, out={self.out_features}, parts=[{kinds}]"


def make_linear(
    parts: list[torch.Tensor | QuantWeight], bias: torch.Tensor | None = None, *, invariant: bool = False
) -> Linear:
    """A Linear over row-stacked parts; quantized parts of one form are packed together.

    ``invariant``: float parts go to the batch-invariant float kernel (``fp32``
    parts) instead of BLAS -- for the float layers of a quantized model, so that
    the whole model keeps the batch-invariance guarantee.
    """
    k = int(parts[0].shape[1])
    n = sum(int(p.shape[0]) for p in parts)
    lin = Linear(k, n)
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    floats = [p for p in parts if not isinstance(p, QuantWeight)]
    if len(quant) == len(parts) and (stacked := concat_qweights(quant)) is not None:
        lin.add_quant(ql.pack(stacked))
    elif not quant:
        w = torch.cat(floats) if len(floats) > 1 else floats[0]  # type: ignore[arg-type]
        lin.add_fp32(w) if invariant else lin.add_dense(w)
    else:
        for p in parts:
            if isinstance(p, QuantWeight):
                lin.add_quant(ql.pack(p))
            elif invariant:
                lin.add_fp32(p)
            else:
                lin.add_dense(p)
    lin.set_bias(bias)
    lin.finish()
    return lin
