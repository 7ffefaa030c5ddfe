"""Batch invariance for a float target: its BLAS linears moved to sluice's fixed-order float kernel.

NOTE(spec-invariance): verification is bit-identical to decoding without
speculation only where a position's logits do not depend on the query tokens
computed beside it.  The quantized kernels and the paged attention give that;
BLAS does not (its blocking, and so its rounding, changes with the number of
rows: ~1e-5 on SmolLM2's layers).  So an engine that speculates runs a float32
model's linears on the batch-invariant float kernel that a quantized model's
float layers use (``make_linear(..., invariant=True)``), in every step, with or
without drafts; its output is then the same whatever k the policy picks.  On
other dtypes and devices nothing is moved and greedy output may differ from an
engine without speculation where two tokens tie within rounding.
"""

from __future__ import annotations

import torch

from sluice.kernels.linear import Linear, make_linear

__all__ = ["make_batch_invariant"]


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Rebuild every all-dense float32 Linear of ``model`` on the invariant kernel; returns how many."""
    rebuilt: dict[int, Linear] = {}  # id(old) -> new (a tied embedding is one module under two names)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or not child.parts or any(k != "dense" for k, _, _ in child.parts):
                continue
            new = rebuilt.get(id(child))
            if new is None:
                weights = [child.dense_weight(i) for i in range(len(child.parts))]
                if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
                    continue
                w = torch.cat(weights) if len(weights) > 1 else weights[0]
                new = rebuilt[id(child)] = make_linear([w], child.bias, invariant=True)
                new.prepare()  # the C++ op: without it the float parts would go through F.linear
            setattr(parent, name, new)
    return len(rebuilt)
