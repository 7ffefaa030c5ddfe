"""Write the embedded SmolLM2 GGUF as a HuggingFace folder (fp32 safetensors + tokenizer), for peers.

    python benchmarks/export_hf.py .peer/smollm2-hf

vLLM serves HF folders; this gives it exactly the weights sluice serves (the
GGUF dequantized with sluice's loader), so side-by-side runs compare engines,
not weights.
"""

from __future__ import annotations

import sys


def main(out: str) -> None:
    import torch
    import transformers

    from sluice.models.loader import (
        _gguf_reader,
        gguf_hf_config,
        load_gguf_state_dict,
        resolve_model,
    )
    from sluice.models.tokenizer import load_tokenizer

    src = resolve_model("smollm2")
    reader = _gguf_reader(src.path)
    cfg = gguf_hf_config(reader, src.path)
    sd = load_gguf_state_dict(reader, src.path, cfg)
    conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    conf.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(conf).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(src).hf.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".peer/smollm2-hf")
