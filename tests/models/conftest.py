"""Fixtures for the quantization tests: small GGUF files and tiny HF models built per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hub_factory, gguf_factory

from model_factory import make_tiny_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # K of every linear a multiple of 32 (hidden 64, intermediate 128), so every group size fits
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-q"), "llama", seed=3)
