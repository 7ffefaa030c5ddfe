"""Speculative decoding: the same greedy answers, fewer target steps.

    python examples/speculative.py

Two uses on the embedded SmolLM2 (docs/speculative.md):

- n-gram drafts (prompt lookup) on the default Q4_1 path, for an answer that copies its prompt;
- the float32 model (``quantization="none"``, the one that answers "Paris"), drafted by its own Q4_1
  weights (``"self:q4"``): the float32 answer at close to the 4-bit path's speed.

Each prints tok/s with and without drafts, whether the tokens are the same, and the engine's own counters
(drafted, kept).  The server takes the same setting: ``sluice serve --speculative-config '{...}'`` (or
``auto``), and ``sluice bench`` then reports the counters per phase.
"""

import time

from sluice import LLM, SamplingParams

COPY = ("Repeat the following text exactly:\n\nThe meeting is on Tuesday at ten in room 4B. Alice will present "
        "the budget, Bob will report on the new warehouse, and Carol will answer questions about the hiring plan.")  # fmt: skip
QUESTION = "What is the capital of France? Give three facts about it."
params = SamplingParams(temperature=0, max_tokens=64)


def chat(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(llm: LLM, text: str) -> tuple[list[int], str, float]:
    prompt = chat(llm, text)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))  # warm-up (kernel plans, the draft's load)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return out.token_ids, out.text, len(out.token_ids) / (time.perf_counter() - t0)


def compare(title: str, text: str, plain: LLM, drafted: LLM) -> None:
    ids0, text0, tps0 = run(plain, text)
    s0 = drafted.engine.make_stats()
    ids1, _, tps1 = run(drafted, text)
    s1 = drafted.engine.make_stats()
    n, kept = s1.spec_drafted_tokens - s0.spec_drafted_tokens, s1.spec_accepted_tokens - s0.spec_accepted_tokens
    print(f"{title}: {tps0:6.1f} tok/s without drafts, {tps1:6.1f} with ({tps1 / tps0:.2f}x); "
          f"same tokens: {ids1 == ids0}; drafted {n}, kept {kept}")  # fmt: skip
    print(f"  answer: {text0.strip()[:80]!r}")
    for llm in (plain, drafted):
        llm.engine.close(checkpoint=False)


compare("ngram, Q4_1 path", COPY, LLM("smollm2"),
        LLM("smollm2", speculative_config={"method": "ngram", "num_speculative_tokens": 4}))  # fmt: skip
compare("self:q4, float32 target", QUESTION, LLM("smollm2", quantization="none"),
        LLM("smollm2", quantization="none", speculative_config={"model": "self:q4", "num_speculative_tokens": 4}))  # fmt: skip
