"""Mixture-of-experts: the router picks what transformers picks, every expert runs in some test, the
grouped expert pass gives the bits of running the experts one by one, and a request's logits do not
depend on the batch it shares (quantized experts on sluice's kernels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from arch_factory import hf_model, make_arch_dir, write_arch_gguf

from sluice.models.attention import masked_attention
from sluice.models.loader import load_model, resolve_model
from sluice.models.moe import MoEBlock

MOE_ARCHS = ["qwen3_moe", "olmoe", "mixtral"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {a: make_arch_dir(root / a, a, seed=5) for a in MOE_ARCHS}


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def hf_router_inputs(hf: Any, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer -> (the MoE block's input (T, H), transformers' chosen experts (T, k))."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        block = getattr(layer, "mlp", None) or layer.block_sparse_moe

        def hook(mod: Any, args: Any, out: Any, i: int = i) -> None:
            seen[i] = (args[0].reshape(-1, args[0].shape[-1]).clone(), out[2].clone())  # (logits, scores, indices)

        hooks.append(block.gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(ids[None])
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_choices_equal_transformers_and_every_expert_gets_rows(moe_dirs: dict[str, Path], arch: str) -> None:
    hf = hf_model(moe_dirs[arch])
    model = load_model(resolve_model(str(moe_dirs[arch])), torch.float32)
    used: dict[int, set[int]] = {}
    for seed in range(3):
        for i, (x, want) in hf_router_inputs(hf, ids_of(24, seed)).items():
            moe = model.layers[i].moe
            assert isinstance(moe, MoEBlock)
            w, got = moe.route(x)
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), f"{arch} layer {i}: router choices differ"
            if moe.normalize:
                assert torch.allclose(w.sum(-1), torch.ones(len(w))), "normalised top-k weights sum to 1"
            used.setdefault(i, set()).update(got.flatten().tolist())
    for i, experts in used.items():
        assert experts == set(range(8)), f"{arch} layer {i}: experts {sorted(experts)} got rows, the test must reach all 8"


@pytest.fixture(scope="module")
def quantized_moe(moe_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("moe-gguf")
    g = write_arch_gguf(moe_dirs["qwen3_moe"], d / "qwen3_moe.Q4_0.gguf", "Q4_0")
    import os

    old = os.environ.get("SLUICE_CACHE_DIR")
    os.environ["SLUICE_CACHE_DIR"] = str(d / "cache")
    try:
        return load_model(resolve_model(str(g)), torch.float32, quantization="auto")
    finally:
        if old is None:
            del os.environ["SLUICE_CACHE_DIR"]
        else:
            os.environ["SLUICE_CACHE_DIR"] = old


def test_grouped_expert_pass_gives_the_bits_of_experts_one_by_one(quantized_moe: Any) -> None:
    moe = quantized_moe.layers[0].moe
    assert all(ex.gate_up.is_quantized and ex.down.is_quantized for ex in moe.experts), "experts run on the quantized kernels"
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    act = lambda gu: quantized_moe.ops.act_mul(gu, "silu")  # noqa: E731
    grouped = moe(x, act)
    assert torch.equal(grouped, moe.forward_one_by_one(x, act)), "NOTE(grouped-experts): same bits as one by one"
    _, ids = moe.route(x)
    assert len(set(ids.flatten().tolist())) == moe.num_experts, "every expert ran over several rows here"


def flat_batch_attention(starts: list[int], scale: float) -> Any:
    """Causal attention over a flat batch of whole sequences starting at ``starts`` (plus the end)."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **opts: Any) -> torch.Tensor:
        out = torch.empty_like(q)
        for s, e in zip(starts, starts[1:]):
            out[s:e] = masked_attention(q[s:e], k[s:e], v[s:e], **{"scale": scale, **opts})
        return out

    return attend


def test_a_requests_logits_do_not_depend_on_its_batch(quantized_moe: Any) -> None:
    m = quantized_moe
    a, others = ids_of(9, 10), [ids_of(n, 20 + n) for n in (1, 5, 30)]
    alone = m.compute_logits(m(a, torch.arange(9), flat_batch_attention([0, 9], m.cfg.head_dim**-0.5)))
    for b in others:
        ids = torch.cat([b, a])
        pos = torch.cat([torch.arange(len(b)), torch.arange(9)])
        att = flat_batch_attention([0, len(b), len(b) + 9], m.cfg.head_dim**-0.5)
        batched = m.compute_logits(m(ids, pos, att))[len(b):]
        assert torch.equal(batched, alone), f"logits changed when batched with {len(b)} other tokens"


def test_gguf_experts_unpack_lazily_and_are_released_once_packed(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    from sluice.models.config import ModelConfig
    from sluice.models.files import gguf_hf_config, gguf_reader
    from sluice.models.llama import LlamaForCausalLM
    from sluice.models.quant.gguf import LazyQuantWeight, gguf_quant_state_dict, qweight_from_blocks

    g = write_arch_gguf(moe_dirs["olmoe"], tmp_path / "olmoe.Q8_0.gguf", "Q8_0")
    reader = gguf_reader(g)
    cfg = gguf_hf_config(reader, g)
    sd = gguf_quant_state_dict(reader, g, cfg)
    experts = {k: v for k, v in sd.items() if ".experts." in k}
    assert len(experts) == 2 * 8 * 3 and all(isinstance(v, LazyQuantWeight) and not v.is_loaded for v in experts.values())
    w = experts["model.layers.1.mlp.experts.5.down_proj.weight"]
    stack = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    import numpy as np

    eager = qweight_from_blocks(np.asarray(stack.data).reshape(8, -1)[5], "Q8_0", w.shape)
    assert torch.equal(w.dequantize(), eager.dequantize()) and w.is_loaded
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg))
    model.load_hf_state_dict(sd)
    assert not any(v.is_loaded for v in experts.values()), "NOTE(lazy-experts): unpacked integers dropped once packed"
    assert all(ex.down.is_quantized for layer in model.layers for ex in layer.moe.experts)


def test_older_mixtral_gguf_files_with_one_tensor_per_expert(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp wrote mixtral's experts as blk.N.ffn_gate.E.weight before it stacked them."""
    from gguf import GGUFReader, GGUFWriter

    stacked = write_arch_gguf(moe_dirs["mixtral"], tmp_path / "stacked.gguf", "F32")
    old = tmp_path / "old.gguf"
    r = GGUFReader(str(stacked))
    w = GGUFWriter(str(old), "llama")
    for key, field in r.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    for t in r.tensors:
        arr = torch.from_numpy(t.data.copy()).numpy()
        if "_exps." in t.name:
            kind = t.name.split(".")[2].removesuffix("_exps")
            for e in range(arr.shape[0]):
                w.add_tensor(f"blk.{t.name.split('.')[1]}.{kind}.{e}.weight", arr[e].copy())
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ids = ids_of(12, 3)
    att = flat_batch_attention([0, 12], 16**-0.5)
    a, b = (load_model(resolve_model(str(p)), torch.float32) for p in (stacked, old))
    assert torch.equal(a.compute_logits(a(ids, torch.arange(12), att)), b.compute_logits(b(ids, torch.arange(12), att)))


def random_q4_k_stack(rng: Any, n_exp: int, rows: int, cols: int) -> Any:
    """Valid random Q4_K blocks for an (experts, rows, cols) stack: (E, rows, cols / 256 * 144) uint8."""
    import numpy as np

    nb = n_exp * rows * cols // 256
    blocks = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)
    d = (rng.choice([-1.0, 1.0], nb) * rng.uniform(0.5, 1.5, nb) * 1e-3).astype(np.float16)
    dmin = (rng.uniform(0.5, 1.5, nb) * 1e-3).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n_exp, rows, cols // 256 * 144)


def test_q4_k_expert_stacks_match_the_dequantized_reference(tmp_path: Path) -> None:
    """Real MoE GGUFs are K-quants (Q4_K_M): experts as Q4_K stacks, against transformers on their values."""
    import json
    import shutil

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
    from safetensors.numpy import load_file, save_file

    d = make_arch_dir(tmp_path / "wide", "qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64, seed=2)
    f32 = write_arch_gguf(d, tmp_path / "f32.gguf", "F32")
    q4k = tmp_path / "q4k.gguf"
    r, w = GGUFReader(str(f32)), GGUFWriter(str(q4k), "qwen3moe")
    for key, field in r.fields.items():
        if key.startswith("qwen3moe."):
            w.add_key_value(key, field.contents(), field.types[0])
    rng = np.random.default_rng(0)
    twin = tmp_path / "twin"
    shutil.copytree(d, twin)
    sd = load_file(str(d / "model.safetensors"))
    kinds = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    for t in r.tensors:
        arr = np.array(t.data)
        parts = t.name.split(".")
        layer, kind = (parts[1], parts[2]) if len(parts) == 4 else ("", "")
        if kind in kinds:
            n_exp, rows, cols = arr.shape
            blocks = random_q4_k_stack(rng, n_exp, rows, cols)
            w.add_tensor(t.name, blocks, raw_dtype=GGMLQuantizationType.Q4_K)
            values = quants.dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(n_exp, rows, cols)
            for e in range(n_exp):
                sd[f"model.layers.{layer}.mlp.experts.{e}.{kinds[kind]}.weight"] = values[e].astype(np.float32)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(sd, str(twin / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((twin / "config.json").read_text())["hidden_size"] == 256
    ids = ids_of(16, 8)
    with torch.no_grad():
        ref = hf_model(twin)(ids[None]).logits[0]
    att = flat_batch_attention([0, 16], 64**-0.5)
    exact = load_model(resolve_model(str(q4k)), torch.float32, quantization="none")
    assert (exact.compute_logits(exact(ids, torch.arange(16), att)) - ref).abs().max().item() <= 1e-3
    native = load_model(resolve_model(str(q4k)), torch.float32, quantization="auto")
    assert all(ex.gate_up.is_quantized for layer in native.layers for ex in layer.moe.experts)
    got = native.compute_logits(native(ids, torch.arange(16), att))
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).sort().values
    assert rel[int(0.9 * len(rel)) - 1] < 0.1, f"Q4_K experts on the kernels: {rel.tolist()}"
