"""Speculative decoding (issue 55, docs/speculative.md): proposers draft, one target step verifies.

    (``sluice.engine.spec_config``: ``--speculative-config``, parsed; torch-free, for the engine config)
    ngram.py     prompt-lookup drafts
    draft.py     the draft model and its paged KV cache (``self:q4``)
    proposer.py  the proposers behind one interface, and their factory
    policy.py    k per request and step, from the step-time model and each request's acceptance
    verify.py    which drafts the target keeps (bit-identical to decoding without speculation)
"""
