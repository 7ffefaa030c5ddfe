"""Quantized weights: the same model served as its GGUF 4-bit blocks (the
default, ``quantization="auto"``), re-quantized to int8, and dequantized to
float32 (``"none"``); the kernel path each one runs and its decode speed.

    python examples/quantization.py

Each variant's converted weights are cached (~/.cache/sluice/models-v3), so a
second run starts in seconds.  ``sluice doctor`` names the kernel path this
CPU gets and why.
"""

import time

from sluice import LLM, SamplingParams

PROMPT = "The three primary colors are"
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

for quantization in ("auto", "int8", "none"):
    llm = LLM("smollm2", quantization=quantization)
    info = llm.engine.model_info
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate([PROMPT], params)[0]
    dt = time.perf_counter() - t0
    print(f"quantization={quantization:<5} weights={info.quantization:<28} kernels={info.kernel_path or '-':<22} "
          f"{len(out.token_ids) / dt:6.1f} tok/s  {out.text[:48]!r}")
    llm.engine.close(checkpoint=False)
