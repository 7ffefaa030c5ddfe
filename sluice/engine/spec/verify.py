"""Verification: which drafted tokens the target keeps.

NOTE(coupled-verification): every position of a speculating request (its
pending token and each draft) gets a sampling row of its own in the target
step, and each row is sampled exactly as it would be without speculation:
greedy rows take the argmax, sampled rows ``argmax p / E`` with the next
exponential noise vector ``E`` of the request's own generator.  Draft ``j`` is
kept while it equals the target's token at its position; the first target
token that differs is kept too and ends the run (all kept: the target's token
after the last draft is a bonus).  So the tokens emitted are the tokens the
target samples at those positions, from the same logits (the kernels are batch
invariant: a position's logits do not depend on the query tokens beside it)
and the same noise: the generator is set back to where the last emitted
token's draw left it (``SamplingRow.states``), so the noise of the rejected
positions is drawn again for them next step.  Greedy output, and a seeded
request's sampled output, are bit-identical to non-speculative decoding; the
distribution of any request's output is the target's, exactly.

NOTE(spec-invariance): bit-identical where the target's kernels are batch
invariant: quantized weights (the default Q4_1 path, int8/int4 at load),
float32 weights on the fixed-order float kernel (NOTE(float-kernel) in
``ModelRunner._invariant_floats``), and the paged attention on the CPU.  BLAS
rounds a decode's one row (a gemv) and a verification's k + 1 (a gemm)
differently, so a model left on BLAS (bfloat16, an MoE model's float experts,
a GPU, ``SLUICE_FLOAT_KERNEL=blas``) can give other greedy output where two
tokens tie within the rounding (~1e-5).  (An earlier note here kept float
models on BLAS because the float kernel was ~10x slower: float-only layers
then got no kernel plan and ran its scalar loop.)  For a draft
For a draft
that is one token (n-gram) a draft is kept with probability ``p(draft)``, what
the classical rejection-sampling rule gives; for a draft model the coupled
noise (NOTE(coupled-drafts) in ``proposer``) keeps its acceptance close to it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["accepted_run"]


def accepted_run(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a request emits: ``sampled`` (one per position: ``len(drafts) + 1``) up to and
    including the first that differs from its draft (NOTE(coupled-verification))."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return list(sampled[: m + 1])
