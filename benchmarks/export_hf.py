"""Write a GGUF model as a HuggingFace folder (fp32 safetensors + tokenizer), for peers.

    python benchmarks/export_hf.py .peers/smollm2-hf                                   # the embedded SmolLM2
    python benchmarks/export_hf.py --model .peers/llama1b/llama1b-q4_0.gguf .peers/llama1b-hf

vLLM serves HF folders; this gives it exactly the weights sluice serves (the
GGUF dequantized with sluice's reader), so side-by-side runs compare engines,
not weights.  A 1B model is about 5 GB in fp32.
"""

from __future__ import annotations

import argparse


def export(model: str, out: str) -> None:
    import torch
    import transformers

    from sluice.models.files import gguf_hf_config, gguf_reader, load_gguf_state_dict
    from sluice.models.source import resolve_model
    from sluice.models.tokenizer import load_tokenizer

    src = resolve_model(model)
    if src.kind != "gguf":
        raise SystemExit(f"{model} is already a HuggingFace folder ({src.path})")
    reader = gguf_reader(src.path)
    cfg = gguf_hf_config(reader, src.path)
    sd = load_gguf_state_dict(reader, src.path, cfg)
    conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    conf.architectures = ["LlamaForCausalLM"]
    hf = transformers.LlamaForCausalLM(conf).to(torch.float32).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or any("lm_head" not in m for m in missing):
        raise SystemExit(f"weights do not match a LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.save_pretrained(out, safe_serialization=True)
    load_tokenizer(src).hf.save_pretrained(out)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=".peers/smollm2-hf", help="output folder (default .peers/smollm2-hf)")
    ap.add_argument("--model", default="smollm2", help="smollm2 or a .gguf file")
    args = ap.parse_args(argv)
    export(args.model, args.out)


if __name__ == "__main__":
    main()
