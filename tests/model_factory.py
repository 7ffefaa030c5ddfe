"""Tiny random Llama / Qwen2 models for tests, written as HuggingFace directories.

    make_tiny_model_dir(tmp_path, arch="llama")  -> Path with config.json,
        model.safetensors, generation_config.json and the SmolLM2 tokenizer
        (vocab 49152, chat template), so both sluice and transformers load it.

Weights are random but seeded, and drawn with a wide init so that logits are
peaked enough for greedy decoding to be stable across implementations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["make_tiny_model_dir", "stable_mtimes", "TINY_DEFAULTS"]

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}


def make_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    import torch
    import transformers

    from sluice.models.tokenizer import load_tokenizer

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    kw = {**TINY_DEFAULTS, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**kw)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():  # norms drawn around 1 so every layer matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    load_tokenizer("smollm2").hf.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": kw["eos_token_id"], "bos_token_id": kw["bos_token_id"]}))
    stable_mtimes(path)
    return path


def stable_mtimes(path: Path) -> None:
    """Give each weight file an mtime drawn from its content's hash.

    A HF folder's cache key (models/source.py) is its config plus each weight
    file's name, size and mtime: with fresh mtimes, every run of the suite added
    new converted-weights cache entries for the same models.  With these, the
    same model gets the same key run after run, and a different one another.
    Every test helper that writes a model folder calls it.
    """
    import hashlib
    import os

    for f in sorted(path.glob("*.safetensors")):
        h = int.from_bytes(hashlib.sha256(f.read_bytes()).digest()[:4], "little")
        t = 1_000_000_000 + h  # 2001-2137: plain seconds, any filesystem keeps them
        os.utime(f, (t, t))
