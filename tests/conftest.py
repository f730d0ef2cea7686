"""Shared fixtures: tiny targets built once per session from transformers configs (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random-weight Qwen3 target with a ChatML tokenizer."""
    from common.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random-weight Llama target with the same tokenizer."""
    from common.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
