"""Review of extraction's durability: a run stopped at any point resumes (or starts over with
--overwrite) without losing, duplicating or half-counting a shard."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
from test_extract import cli_extract, make_config, write_data

from common.store import committed_shards, open_store
from common.store_files import file_problems, recorded_files
from stage1_extract.job import plan_job
from stage1_extract.run import run_extract
from stage1_extract.store_root import _explain_mismatch, prepare_store, writer_lock

LAYERS = "target.tapped_layers=[0,1,3]"


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("review-durability")
    out = folder / "store"
    run_extract(make_config(tiny_qwen3, write_data(folder), out, LAYERS))
    return out


@pytest.mark.parametrize("zarr_json", ["listed first", "listed last"])
def test_overwrite_stopped_while_deleting_leaves_a_store_to_rerun(
    zarr_json: str, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while --overwrite deletes the old shards (minutes for a large store): the folder
    must stay a store that a rerun with --overwrite deletes, and one that a rerun without it
    resumes, never counting a half-deleted shard as committed. The file system decides the order
    in which the folder lists its entries: both orders are tried."""
    store = Path(shutil.copytree(reference, tmp_path / "store"))
    # the root attributes a run of the same command starts a store with
    attrs = {k: v for k, v in open_store(store).attrs.items() if k != "counts"}
    attrs["complete"] = False
    listed = Path.iterdir

    def ordered(self: Path):
        return sorted(
            listed(self), key=lambda p: (p.name == "zarr.json") == (zarr_json == "listed last")
        )

    real_rmtree = shutil.rmtree

    def stopped(path, *args, **kwargs):
        if "shards" in Path(path).name:  # one shard half gone, then Ctrl-C
            shard = next(Path(path).glob("shard-000001"))
            real_rmtree(shard / "hidden")
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(Path, "iterdir", ordered)
    monkeypatch.setattr(shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt), writer_lock(store):
        prepare_store(store, attrs, overwrite=True)
    monkeypatch.undo()

    damaged = tmp_path / "resumed"  # the old command again, without --overwrite
    shutil.copytree(store, damaged)
    with writer_lock(damaged):
        done = prepare_store(damaged, attrs, overwrite=False)
    for index in done:
        folder = damaged / "shards" / f"shard-{index:06d}"
        assert not file_problems(folder, recorded_files(folder)), index
    assert [p.name for p in damaged.glob(".tmp-*")] == []  # nothing left behind for good

    with writer_lock(store):  # --overwrite again: the store starts over
        assert prepare_store(store, attrs, overwrite=True) == []
    assert committed_shards(store) == [] and not open_store(store).complete


def test_overwrite_after_a_stopped_overwrite_of_the_same_pid(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container every run may get the same pid: what a stopped --overwrite set aside
    under this pid's name is no obstacle to the next --overwrite."""
    store = Path(shutil.copytree(reference, tmp_path / "store"))
    left = store / f".tmp-shards-{os.getpid()}"
    shutil.copytree(store / "shards", left)
    attrs = {k: v for k, v in open_store(store).attrs.items() if k != "counts"}
    listed = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: sorted(listed(self), reverse=True))
    with writer_lock(store):
        assert prepare_store(store, attrs, overwrite=True) == []
    assert not left.exists() and committed_shards(store) == []


def test_out_with_a_tilde_is_the_home_folder(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out=~/store` (a shell leaves `~` alone after `=`, a YAML config too) is the store in
    the home folder, as train reads it, not a folder named `~` under the working folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    job = plan_job(make_config(tiny_qwen3, write_data(tmp_path), Path("~/store"), LAYERS))
    assert job.store == home / "store"


def test_a_damaged_root_names_a_fix_that_works(
    reference: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    """An unreadable root zarr.json (a power cut, an edit by hand): extract refuses it, even with
    --overwrite (it never deletes a folder it cannot tell is a store), so the message must not
    send the user to --overwrite; what it says instead (delete the folder) then works."""
    store = Path(shutil.copytree(reference, tmp_path / "store"))
    (store / "zarr.json").write_text("{ cut")
    data = reference.parent / "data.jsonl"
    result = cli_extract(tiny_qwen3, data, store, LAYERS, "store.overwrite=true")
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "root metadata is damaged" in message
    assert "--overwrite" not in message and f"delete the folder {store}" in message
    shutil.rmtree(store)
    assert cli_extract(tiny_qwen3, data, store, LAYERS).exit_code == 0
    assert open_store(store).complete


def _rerun_attrs(store: Path, **changes: object) -> tuple[dict, dict]:
    """(the store's root attributes, those of a rerun with `changes` to its config)."""
    old = open_store(store).attrs
    new = copy.deepcopy(old)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        new["extract_config"][section][key] = value
    return old, new


def test_a_changed_seq_len_is_named_with_the_set_that_resumes(reference: Path) -> None:
    """packing.seq_len is one setting: the refusal names it once and offers the --set that
    gives the store's value back (the packing section listed beside it withheld that)."""
    old, new = _rerun_attrs(reference, packing__seq_len=128)
    new["seq_len"] = 128
    assert _explain_mismatch(old, new) == (
        "packing.seq_len (64 -> 128)",
        ["--set packing.seq_len=64"],
    )


def test_a_path_spelled_otherwise_is_not_named_as_changed(reference: Path) -> None:
    """`--model m/` after `--model m` (a shell's completion adds the slash), or `./m` for `m`:
    the same folder, the same content key; a refusal for another reason must not blame it."""
    old, new = _rerun_attrs(reference, packing__seq_len=128)
    new["seq_len"] = 128
    new["target"]["name_or_path"] += "/"
    new["tokenizer"]["name_or_path"] += "/"
    folder, name = new["dataset"]["path"].rsplit("/", 1)
    new["dataset"]["path"] = new["extract_config"]["data"]["path"] = f"{folder}/./{name}"
    assert _explain_mismatch(old, new)[0] == "packing.seq_len (64 -> 128)"
