"""Shared fixtures: tiny targets built once per session from transformers configs (no downloads)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread for torch here and in every process a test starts (read as torch loads):
# the tests' tensors are too small to split, and threads of two processes (gloo ranks, a
# launcher's workers, a CLI run) spinning for one another on CI's 2 cores cost more than they
# gain (the suite ran ~5% faster, its CPU time 12% lower); set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="module")
def _long_lived_objects_frozen() -> Iterator[None]:
    """Every full garbage collection in this process walks every object it tracks: ~450k once
    torch, transformers and the test modules are imported, ~0.2 s a pass, and training makes
    one at its start and after each evaluation (stage2_train/gc_schedule.py), dozens in a test
    file. Before each file, after a collection (no garbage is frozen), the objects that live on
    (modules, session fixtures) are frozen out of those passes; collections still run where and
    when they did, over everything the tests make."""
    gc.collect()
    gc.freeze()
    yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "plots: training in this test draws its PNG plots (conftest: the others don't)"
    )


@pytest.fixture(autouse=True)
def _training_draws_no_plots(request: pytest.FixtureRequest, monkeypatch) -> None:
    """Training draws its PNG plots at each evaluation and at the end (~0.3 s of matplotlib
    each, a third of a tiny run); no test looks at them but those marked `plots` and
    test_trackers' run (built before this fixture), and a plot that fails is only a warning
    (`draw_plots_safely`), so elsewhere the call is a no-op. Training in a process a test
    starts still draws them."""
    if request.node.get_closest_marker("plots") is None:
        from stage2_train import train

        monkeypatch.setattr(train, "draw_plots_safely", lambda out: None)


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


@pytest.fixture(scope="session")
def tiny_eos_target(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3 with the LM head's rows of its end of sequence and of its most frequent greedy
    token swapped: it writes an end of text wherever tiny_qwen3 writes that token, and goes on
    after it (a random target almost never ends a text by itself)."""
    from collections import Counter

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    written: Counter[int] = Counter()
    texts = ["the quick brown fox jumps over the lazy dog " * 6, "import os\nimport sys\n" * 4]
    for text in texts:  # 12-token windows, as the tests' text rows
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts = torch.tensor([ids[s : s + 12] for s in range(0, len(ids) - 12, 20)])
        with torch.no_grad():
            replies = model.generate(prompts, max_new_tokens=8, do_sample=False, eos_token_id=None)
        written.update(replies[:, 12:].flatten().tolist())
    frequent = written.most_common(1)[0][0]
    eos = tokenizer.eos_token_id
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[[eos, frequent]] = head[[frequent, eos]].clone()
    out = tmp_path_factory.mktemp("tiny-eos")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
