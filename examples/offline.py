"""Offline generation with sluice.LLM on the embedded SmolLM2 model.

    python examples/offline.py
"""

from sluice import LLM, SamplingParams

llm = LLM("smollm2")
outs = llm.generate(
    ["The capital of Germany is", "def fibonacci(n):"],
    SamplingParams(temperature=0, max_tokens=24),
)
for o in outs:
    print(repr(o.text), o.finish_reason, f"ttft={o.timings.ttft:.3f}s")

answer = llm.chat([{"role": "user", "content": "Name the capital of France."}], SamplingParams(temperature=0, max_tokens=32))
print(answer[0].text)

for piece in llm.stream("Once upon a time", SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32)):
    print(piece, end="", flush=True)
print()
