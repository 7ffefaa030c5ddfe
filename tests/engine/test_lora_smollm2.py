"""LoRA adapters on SmolLM2 (slow): random adapters the test writes, against the merged reference,
on the float twin of the GGUF and on the native Q4_1/Q8_0 path; a mixed batch on the native path.

NOTE(q4-reference) in tests/engine/test_lora.py: for a quantized base the merged reference is the
dequantized weights plus s*B@A in fp32; the served Q4 path must stay within the base model's own
gap to its dequantized twin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_factory import ALL_TARGETS, make_lora_dir, merge_into_model  # noqa: E402

from sluice.engine.config import EngineConfig  # noqa: E402
from sluice.engine.core import EngineCore  # noqa: E402
from sluice.engine.protocol import SamplingParams  # noqa: E402
from tests.engine.test_lora import max_diff, prompt, run  # noqa: E402

pytestmark = pytest.mark.slow

KV = 64 << 20


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sluice.models.config import ModelConfig
    from sluice.models.loader import load_model_config, resolve_model

    cfg = ModelConfig.from_hf(load_model_config(resolve_model("smollm2")))
    root = tmp_path_factory.mktemp("smollm2-lora")
    return {
        "qv": make_lora_dir(root / "qv", cfg, targets=("q_proj", "v_proj"), rank=16, seed=1, std=0.03),
        "all": make_lora_dir(root / "all", cfg, targets=ALL_TARGETS, rank=8, seed=2, std=0.03),
        "attn": make_lora_dir(root / "attn", cfg, targets=("k_proj", "o_proj"), rank=4, seed=3, std=0.03),
    }


def test_smollm2_adapters_against_the_merged_reference(adapters: dict[str, Path]) -> None:
    """Float twin (the GGUF dequantized): adapter == merge within 1e-3, greedy tokens equal.
    Native Q4_1/Q8_0: within twice the base model's own gap to the float twin."""
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    p = prompt(21, 40)
    mods = [f"{n}={path}" for n, path in adapters.items()]
    native = EngineCore(EngineConfig(model="smollm2", kv_cache_memory=KV, lora_modules=mods))
    q4_base = run(native, [("b", p, None, 0)], first)["b"][1]
    q4 = {n: run(native, [(n, p, n, 0)], first)[n][1] for n in adapters}
    del native
    for name in adapters:
        twin = EngineCore(EngineConfig(model="smollm2", quantization="none", kv_cache_memory=KV,
                                       enable_prefix_caching=False, lora_modules=[f"{name}={adapters[name]}"]))  # fmt: skip
        twin_base = run(twin, [("b", p, None, 0)], first)["b"][1]
        served = run(twin, [("a", p, name, 0)], sp)["a"]
        merge_into_model(twin.runner.model, adapters[name])  # the twin's base is now the merged model
        merged = run(twin, [("m", p, None, 0)], sp)["m"]
        assert served[0] == merged[0], f"{name}: greedy tokens differ from the merged model's"
        assert max_diff(served[1], merged[1]) < 1e-3, f"{name}: logits differ from the merged model's"
        assert max_diff(served[1][:1], twin_base) > 0.1, f"{name}: the adapter must change the logits"
        base_gap = max_diff(q4_base, twin_base)
        lora_gap = max_diff(q4[name], merged[1][:1])
        assert lora_gap <= 2 * base_gap + 1e-3, f"{name}: Q4 + adapter {lora_gap:.3g} from the merge, base {base_gap:.3g}"
        best = merged[1][0]
        chosen = int(q4[name][0].argmax())
        assert best.max() - best[chosen] <= 2 * lora_gap, f"{name}: Q4's top token is not a near-tie of the merge's"
        del twin


def test_smollm2_mixed_batch_is_bit_identical_to_alone(adapters: dict[str, Path]) -> None:
    mods = [f"{n}={path}" for n, path in adapters.items()]
    specs = [("base", prompt(1, 35), None, 0), ("qv", prompt(2, 20), "qv", 0), ("all", prompt(3, 27), "all", 1),
             ("attn", prompt(4, 16), "attn", 2)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    solo = EngineCore(EngineConfig(model="smollm2", kv_cache_memory=KV, lora_modules=mods, max_num_batched_tokens=64))
    alone = {}
    for s in specs:
        alone.update(run(solo, [(s[0], s[1], s[2], 0)], sp))
    del solo
    busy = EngineCore(EngineConfig(model="smollm2", kv_cache_memory=KV, lora_modules=mods, max_num_batched_tokens=19))
    together = run(busy, specs, sp)
    for rid, (toks, rows) in alone.items():
        assert together[rid][0] == toks, f"{rid}: tokens differ between alone and mixed batch"
        for i, (a, b) in enumerate(zip(rows, together[rid][1], strict=True)):
            assert torch.equal(a, b), f"{rid} token {i}: logits differ by {(a - b).abs().max():.3g}"
