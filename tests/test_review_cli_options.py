"""An audit of the options of `dflash evaluate`, `evaluate-offline`, `inspect`, `export`, `convert`
and `plot`: a bad value is one error naming the option, the value and the fix, exit 2, before
any work and with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from store_factory import FactorySpec, build_store

from dflash_offline.cli import main as cli


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("option", ["--json-out", "--plot"])
@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(
    tmp_path: Path, option: str, where: str
) -> None:
    """--json-out (or --plot) naming a folder, or a path under a file, failed once the figures
    were measured ("error: Is a directory: ...", no option named; minutes of evaluate-offline
    on a CPU), and evaluate had written the plot beside it (X.png) first."""
    (tmp_path / "notes.txt").write_text("x")
    value = str(tmp_path if where == "folder" else tmp_path / "notes.txt" / "out.json")
    commands = [
        ["evaluate", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.jsonl")],
        ["evaluate-offline", "--drafter", str(tmp_path / "e"), "--store", str(tmp_path / "s")],
    ]
    for command in commands if option == "--json-out" else commands[:1]:
        code, out = _run(*command, option, value)
        assert code == 2, out
        assert f"Invalid value for '{option}'" in out and value in out, out
        assert ("is a folder" if where == "folder" else "is a file, not a folder") in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert not tmp_path.with_suffix(".png").exists()


def test_inspect_verify_refuses_sample(tmp_path: Path) -> None:
    """`dflash inspect verify STORE --sample 2` verified and decoded nothing, without a word
    that the option was dropped; before the store is read."""
    code, out = _run("inspect", "verify", str(tmp_path), "--sample", "2")
    assert code == 2, out
    assert "--sample 2" in out and f"dflash inspect {tmp_path} --sample 2" in out, out


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--shards", "2-1", "'2-1' is an empty range; write it low-high, e.g. 1-2"),
        ("--arrays", ",", "names no array"),
    ],
)
def test_convert_refuses_a_selection_of_nothing(
    tmp_path: Path, option: str, value: str, expected: str
) -> None:
    """A reversed --shards range selected no shard and was told to run `dflash extract` first
    ('has no committed shard'); an --arrays of no name wrote a file of the index alone."""
    store = build_store(tmp_path / "store", FactorySpec())  # shards 0-2
    out = tmp_path / "out.h5"
    code, text = _run("convert", str(store), str(out), option, value)
    assert code == 2, text
    assert f"{option} {value!r}" in text and expected in text, text
    assert not out.exists()


@pytest.mark.parametrize("dest", ["file", "folder_of_other_files"])
def test_convert_import_refuses_a_dest_that_is_no_store_first(tmp_path: Path, dest: str) -> None:
    """An import into a file failed as 'File exists: DEST', and into a folder of other files
    (a run folder, say) with extract's 'pass the folder extract wrote', both after the target's
    LM head had loaded; --overwrite deleted neither, nor does it now."""
    source = tmp_path / "in.h5"
    source.write_bytes(b"not read: DEST is checked first")
    target = tmp_path / "dest"
    if dest == "file":
        target.write_text("notes")
    else:
        target.mkdir()
        (target / "metrics.jsonl").write_text("{}\n")
    for extra in ([], ["--overwrite"]):
        code, text = _run("convert", str(source), str(target), *extra)
        assert code == 2, text
        assert f"DEST {target}" in text and "pass a new" in text, text
    assert (
        target.is_file()
        if dest == "file"
        else sorted(target.iterdir()) == [target / "metrics.jsonl"]
    )


@pytest.mark.parametrize(
    ("option", "value", "low"),
    [("--num-prompts", 0, 1), ("--prompt-tokens", 0, 1), ("--new-tokens", 1, 2)],
)
def test_evaluate_names_the_flag_out_of_range(
    tmp_path: Path, option: str, value: int, low: int
) -> None:
    """'num_prompts must be >= 1, got 0': the config field's name, not the option typed
    (evaluate-offline names its flags); refused before the target is read."""
    args = ["evaluate", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.jsonl")]
    code, text = _run(*args, option, str(value))
    assert code == 2, text
    assert f"{option} must be >= {low}, got {value}" in text, text


def test_convert_import_names_each_count_out_of_range(tmp_path: Path) -> None:
    """'--sequences-per-shard and --topk must be >= 1' named both, whichever was wrong, and
    not the value given."""
    source = tmp_path / "in.h5"
    source.write_bytes(b"not read: the options are checked first")
    code, text = _run("convert", str(source), str(tmp_path / "s"), "--topk", "0")
    assert code == 2, text
    assert "--topk must be >= 1, got 0" in text and "--sequences-per-shard" not in text, text
    assert not (tmp_path / "s").exists()


def test_convert_interrupted_says_what_stays(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C in an import said 'interrupted (Ctrl-C)' alone: nothing of the shards it had
    committed, nor that the same command resumes it (generate's and extract's say both)."""
    from test_convert import write_input

    import dflash_offline.convert.from_hdf5 as from_hdf5

    h5 = tmp_path / "in.h5"
    write_input(build_store(tmp_path / "store", FactorySpec()), h5, verifier=True, head=True)
    args = ["convert", str(h5), str(tmp_path / "imported"), "--seq-len", "64"]
    args += ["--sequences-per-shard", "2"]
    write_shard, calls = from_hdf5.write_shard, []

    def interrupted_after_one(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(write_shard(*a, **k))

    monkeypatch.setattr(from_hdf5, "write_shard", interrupted_after_one)
    code, text = _run(*args)
    assert code == 130, text
    assert "the shards committed to" in text and "rerun the same command to resume" in text, text
    assert text.startswith("interrupted (Ctrl-C): ") or " interrupted (Ctrl-C): " in text, text
    assert "stopped:" not in text, text  # the form generate's and extract's lines take
    monkeypatch.setattr(from_hdf5, "write_shard", write_shard)
    code, text = _run(*args)
    assert code == 0, text

    monkeypatch.setattr("dflash_offline.convert.to_hdf5._copy_shard", interrupted_after_one)
    code, text = _run("convert", str(tmp_path / "imported"), str(tmp_path / "out.h5"))
    assert code == 130 and "nothing was written to" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported", "in.h5", "store"]


@pytest.mark.parametrize("name", ["plot.pgn", "plot"])
def test_evaluate_refuses_a_plot_matplotlib_cannot_name(tmp_path: Path, name: str) -> None:
    """--plot x.pgn measured everything, then failed in matplotlib ('Format pgn is not
    supported', no option named) with the figures neither printed nor written to --json-out;
    --plot x wrote x.png where the log named x."""
    value = str(tmp_path / name)
    args = ["evaluate", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.jsonl")]
    code, text = _run(*args, "--plot", value)
    assert code == 2, text
    assert "Invalid value for '--plot'" in text and f"e.g. {tmp_path / 'plot.png'}" in text, text


def test_convert_help_says_what_an_import_without_target_reads() -> None:
    """--target's help named no fallback, as if an import needed it (README's example passes
    it); the file's own attributes serve without it (hdf5_input.py's layout)."""
    code, text = _run("convert", "--help")
    assert code == 0, text
    assert "[default: the file's root attribute target, else its target_config" in text, text


def test_convert_import_refuses_a_drafter_export_as_target(tmp_path: Path) -> None:
    """A drafter export as --target loaded as a model (transformers' report of unexpected and
    missing weights), and the import failed on its shapes as if it were a target ('tapped_layers
    [2] are not layers of the 2-layer target')."""
    import json

    from test_convert import write_input

    h5 = tmp_path / "in.h5"
    write_input(build_store(tmp_path / "store", FactorySpec()), h5, verifier=True)
    export = tmp_path / "export"
    export.mkdir()
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1}
    config["dflash_config"] = {"target_layer_ids": [0], "block_size": 16, "mask_token_id": 0}
    (export / "config.json").write_text(json.dumps(config))
    code, text = _run("convert", str(h5), str(tmp_path / "s"), "--target", str(export))
    assert code == 2, text
    assert f"--target {export} is a DFlash drafter export" in text, text
    assert not (tmp_path / "s").exists()


def test_convert_export_under_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    """OUT.h5 under a file was told 'folder X does not exist; create it', of a file that does."""
    store = build_store(tmp_path / "store", FactorySpec())
    (tmp_path / "notes").write_text("x")
    code, text = _run("convert", str(store), str(tmp_path / "notes" / "out.h5"))
    assert code == 2, text
    assert f"{tmp_path / 'notes'} is a file, not a folder" in text, text


@pytest.mark.parametrize(
    ("command", "runner", "unit"),
    [
        ("evaluate", "evaluation.online.run_evaluate", "prompt"),
        ("evaluate-offline", "evaluation.offline.run_offline_eval", "sequence"),
    ],
)
def test_evaluate_interrupted_says_nothing_was_written(
    tmp_path: Path, monkeypatch, command: str, runner: str, unit: str
) -> None:
    """Ctrl-C said 'interrupted (Ctrl-C)' alone, where generate's and extract's name what stays."""

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, interrupted)
    args = ["--target", "T", "--data", "D"] if command == "evaluate" else ["--drafter", "E"]
    args += [] if command == "evaluate" else ["--store", "S"]
    code, text = _run(command, *args, "--json-out", str(tmp_path / "f.json"))
    assert code == 130, text
    assert text.endswith(
        f"interrupted (Ctrl-C): nothing was written: the figures (and --json-out) come once every {unit} is measured"
    ), text
    assert not list(tmp_path.iterdir())
