"""``self:q4`` drafts with a 4-bit copy, never with the target's own 8-bit weights (NOTE(self-q4-bits))."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import make_llama1b_gguf as maker  # noqa: E402
from sluice.engine.spec.draft import draft_source, gguf_layer_bits  # noqa: E402
from sluice.errors import ConfigError  # noqa: E402
from sluice.models.source import ModelSource  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pair")
    q4, q8 = maker.main(["--shape", "tiny", "--types", "q4_0,q8_0", "--out", str(out)])
    return {"q4_0": q4, "q8_0": q8}


def test_self_q4_of_a_4_bit_gguf_is_its_own_weights_and_of_a_q8_0_gguf_int4(pair: dict[str, Path]) -> None:
    assert gguf_layer_bits(pair["q4_0"]) == 4.5 and gguf_layer_bits(pair["q8_0"]) == 8.5
    q4 = ModelSource("t", pair["q4_0"], "gguf")
    q8 = ModelSource("t", pair["q8_0"], "gguf")
    assert draft_source("self:q4", q4) == (q4, "gguf")
    assert draft_source("self:q4", q8) == (q8, "int4"), "a Q8_0 file's own weights would be the target again"
    assert draft_source("self:q4", ModelSource("t", pair["q4_0"].parent, "hf"))[1] == "int4"


def test_a_draft_file_is_served_as_it_is(pair: dict[str, Path]) -> None:
    source, quantization = draft_source(str(pair["q4_0"]), ModelSource("t", pair["q8_0"], "gguf"))
    assert source.path == pair["q4_0"] and quantization == "auto"
    with pytest.raises(ConfigError, match="speculative_config: draft model"):
        draft_source(str(pair["q4_0"].parent / "missing.gguf"), ModelSource("t", pair["q8_0"], "gguf"))
