"""The mask token's string for the export is read from local files only: a store whose tokenizer
is a hub id must not make the trainer ask the hub (without HF_HUB_OFFLINE, an offline machine
sat ~47 s in the hub client's retries at every training start), whether the tokenizer is cached
or not. `dflash export RUN` looks a string training recorded as null up again (from local files
too): a tokenizer downloaded since fills it in."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import pytest
import torch
from huggingface_hub import constants

from common.logging import get_logger
from common.tiny import build_tokenizer, example_texts, tiny_config
from stage2_train.checkpoint import step_dir
from stage2_train.export import export_checkpoint
from stage2_train.mask_token import mask_token_string
from stage2_train.model import DFlashDrafter, DrafterShape

HUB_ID = "fixture/tiny-tok"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target's tokenizer files and config.json (AutoTokenizer reads the config first)."""
    folder = tmp_path_factory.mktemp("tok")
    tokenizer = build_tokenizer(example_texts())
    tokenizer.save_pretrained(folder)
    tiny_config("qwen3", len(tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Hub offline mode off (as on a machine where HF_HUB_OFFLINE is not set; conftest sets it),
    an empty Hugging Face cache, and every HTTP request recorded and refused (this machine has
    no network; a refusal that is not a connection error also skips the client's retries). The
    hub client's own once-per-process fetch of its agent registry (for its request headers;
    3 s timeout, errors swallowed) is refused but not recorded: no tokenizer lookup waits on it."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    requests: list[str] = []

    def refuse(self: object, request: httpx.Request | httpx2.Request) -> None:
        if not str(request.url).endswith("/api/agent-harnesses"):
            requests.append(f"{request.method} {request.url}")
        raise RuntimeError(f"network attempted: {request.method} {request.url}")

    monkeypatch.setattr(httpx2.HTTPTransport, "handle_request", refuse)
    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", refuse)
    yield requests


def cache_hub_id(tokenizer_folder: Path, cache: Path) -> None:
    """`tokenizer_folder` laid out in `cache` as the hub client caches HUB_ID at COMMIT."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for path in tokenizer_folder.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())


def mask_id(tokenizer_folder: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder).mask_token_id


def test_cached_hub_id_is_read_without_the_network(
    tokenizer_folder: Path, online: list[str]
) -> None:
    cache_hub_id(tokenizer_folder, Path(constants.HF_HUB_CACHE))
    token = mask_token_string({"name_or_path": HUB_ID}, mask_id(tokenizer_folder))
    assert (token, online) == ("<|mask|>", [])


def test_local_folder_is_read_without_the_network(
    tokenizer_folder: Path, online: list[str]
) -> None:
    token = mask_token_string({"name_or_path": str(tokenizer_folder)}, mask_id(tokenizer_folder))
    assert (token, online) == ("<|mask|>", [])


def test_uncached_hub_id_gives_none_and_says_what_to_do(
    tokenizer_folder: Path, online: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    log = get_logger()  # (it may not propagate to the root logger caplog reads)
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            token = mask_token_string({"name_or_path": HUB_ID}, mask_id(tokenizer_folder))
    finally:
        log.removeHandler(caplog.handler)
    assert (token, online) == (None, [])
    assert f"hf download {HUB_ID}" in caplog.text
    assert "dflash_config.mask_token" in caplog.text


# ---------------------------------------------------------------- `dflash export RUN`


def write_run(run: Path, mask_id: int, **meta: object) -> Path:
    """A run folder holding one checkpoint of a tiny drafter, its meta.json with `meta`."""
    shape = DrafterShape(
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_tapped=2,
        block_size=4,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        vocab_size=mask_id + 1,
        mask_token_id=mask_id,
    )
    ckpt = step_dir(run, 8)
    ckpt.mkdir(parents=True)
    torch.save(DFlashDrafter(shape).state_dict(), ckpt / "model.pt")
    target = {"tapped_layers": [1, 2], "config": {"num_hidden_layers": 4}}
    full = {"train_state": {}, "config": {}, "shape": dataclasses.asdict(shape), "target": target}
    (ckpt / "meta.json").write_text(json.dumps({**full, **meta}))
    return run


def exported_mask_token(run: Path) -> str | None:
    config = json.loads((export_checkpoint(run) / "config.json").read_text())
    return config["dflash_config"]["mask_token"]


def test_export_fills_a_null_mask_token_once_the_tokenizer_is_downloaded(
    tokenizer_folder: Path, online: list[str], tmp_path: Path
) -> None:
    # trained without the tokenizer in local files: recorded null
    meta = {"tokenizer": {"name_or_path": HUB_ID}, "mask_token": None, "store": "gone"}
    run = write_run(tmp_path / "run", mask_id(tokenizer_folder), **meta)
    assert (exported_mask_token(run), online) == (None, [])
    cache_hub_id(tokenizer_folder, Path(constants.HF_HUB_CACHE))  # `hf download HUB_ID`
    assert (exported_mask_token(run), online) == ("<|mask|>", [])


def test_export_of_an_older_checkpoint_asks_its_store_for_the_tokenizer(
    tokenizer_folder: Path, online: list[str], tmp_path: Path
) -> None:
    """Checkpoints written before meta.json named the tokenizer: the store's root attributes
    name it while the store is there; without it the string stays null."""
    store = tmp_path / "store"
    store.mkdir()
    attrs = {"dflash": {"tokenizer": {"name_or_path": HUB_ID}}}
    zarr_json = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    (store / "zarr.json").write_text(json.dumps(zarr_json))
    cache_hub_id(tokenizer_folder, Path(constants.HF_HUB_CACHE))
    meta = {"mask_token": None, "store": str(store)}
    run = write_run(tmp_path / "run", mask_id(tokenizer_folder), **meta)
    assert (exported_mask_token(run), online) == ("<|mask|>", [])
    gone = write_run(tmp_path / "run2", mask_id(tokenizer_folder), **{**meta, "store": "gone"})
    assert (exported_mask_token(gone), online) == (None, [])


def test_export_keeps_a_recorded_mask_token(
    tokenizer_folder: Path, online: list[str], tmp_path: Path
) -> None:
    cache_hub_id(tokenizer_folder, Path(constants.HF_HUB_CACHE))
    meta = {"tokenizer": {"name_or_path": HUB_ID}, "mask_token": "<recorded>", "store": "gone"}
    run = write_run(tmp_path / "run", mask_id(tokenizer_folder), **meta)
    assert (exported_mask_token(run), online) == ("<recorded>", [])
