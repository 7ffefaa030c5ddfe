"""LoRA adapters on SmolLM2, offline and over HTTP (docs/lora.md).

    python examples/lora.py            # --model PATH for another Llama-family model

Writes three random PEFT adapters (random weights: the point is the
mechanics, not the text), then

1. offline: ``LLM`` with two adapters, one batch mixing the base model and both;
2. over HTTP: ``sluice serve --lora-modules ...``, ``/v1/models``, a completion
   per adapter, ``POST /v1/load_lora_adapter`` of the third, then unload.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from sluice import LLM, SamplingParams
from sluice.models.config import ModelConfig
from sluice.models.loader import load_model_config, resolve_model


def write_adapter(path: Path, cfg: ModelConfig, seed: int, rank: int = 8) -> Path:
    """A PEFT adapter on q_proj and v_proj with random weights (as PEFT saves them)."""
    g = torch.Generator().manual_seed(seed)
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, n_out in (("q_proj", q), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, h, generator=g) * 0.08
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.08
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))
    return path


def offline(model: str, adapters: dict[str, Path]) -> None:
    llm = LLM(model, lora_modules=[f"{n}={adapters[n]}" for n in ("sql", "chat")])
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["The capital of France is"] * 3
    for which, out in zip(["base", "sql", "chat"], llm.generate(prompts, params, lora=[None, "sql", "chat"])):
        print(f"  {which:>5}: {out.text!r}")


def over_http(model: str, adapters: dict[str, Path]) -> None:
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--model", model, "--port", "0", "--log-level", "warning",
           "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}", "--max-loras", "2",
           # the load endpoint is opt-in, and reads adapters from --lora-dir only (docs/server.md)
           "--enable-runtime-lora", "--lora-dir", str(adapters["poem"].parent)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        url = None
        for line in server.stdout:
            m = re.search(r"ready in .* at (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("sluice serve did not start")
        models = httpx.get(url + "/v1/models").json()["data"]
        print("  /v1/models:", [(m["id"], m.get("parent")) for m in models])
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": str(adapters["poem"])}, timeout=120)
        print("  load:", r.status_code, r.text, f"({r.headers.get('x-sluice-lora-load-seconds')} s)")
        for name in (models[0]["id"], "sql", "poem"):
            body = {"model": name, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
            out = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            print(f"  {name:>8}: {out['choices'][0]['text']!r}")
        print("  unload:", httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "poem"}).text)
        r = httpx.post(url + "/v1/completions", json={"model": "poem", "prompt": "x", "max_tokens": 2})
        print("  after unload:", r.status_code, r.json()["error"]["message"])
        metrics = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("sluice_lora_")]
        print("  metrics:", *metrics[:6], sep="\n    ")
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(load_model_config(resolve_model(args.model)))
    with tempfile.TemporaryDirectory(prefix="sluice-lora-example-") as tmp:
        adapters = {n: write_adapter(Path(tmp) / n, cfg, seed) for seed, n in enumerate(["sql", "chat", "poem"])}
        print("offline (sluice.LLM):")
        offline(args.model, adapters)
        print("over HTTP (sluice serve):")
        over_http(args.model, adapters)


if __name__ == "__main__":
    main()
