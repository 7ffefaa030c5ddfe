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
invariant: quantized weights (the default Q4_1 path, int8/int4 at load) and
the paged attention on the CPU.  A float model's linears run BLAS, whose
rounding changes with the number of rows (~1e-5 on SmolLM2's layers), as a
decode's already does with its batch neighbours: its greedy output can differ
where two tokens tie within that.  Moving such a model onto the fixed-order
float kernel would make it exact, but that kernel is ~10x slower than BLAS at
24 rows (a prefill chunk, a batch of drafts), more than drafting saves.  For a draft
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
