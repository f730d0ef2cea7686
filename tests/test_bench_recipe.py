"""bench/recipe_call.sh marks a data stage done only when it succeeded: a stage that fails (here
`dflash generate` refusing an unknown setting, in a second) is rerun by the next call, and the
stages after it do not run on its missing output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bash(
    script: str | Path, cwd: Path, env: dict[str, str], timeout: int
) -> subprocess.CompletedProcess:
    """A bench shell script run as the device runs it: `bash SCRIPT` in `cwd`, output captured."""
    return subprocess.run(
        ["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _stubbed_recipe(
    tmp_path: Path, dflash_body: str, **settings: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """bench/recipe_pystd.sh from a copy of bench/, with `dflash` a stub script (`dflash_body`
    after its #!) on the PATH and `settings` in its environment: the script's own control
    flow. Returns the run and its $OUT."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "dflash").write_text(f"#!/bin/bash\n{dflash_body}")
    # bench/loader_cost.py, the store diagnostics' second command, reads a real store (there is
    # none: it failed, its output unread, after ~2.5 s of imports); any other python3 runs
    python3 = shutil.which("python3") or sys.executable
    (shim / "python3").write_text(
        f'#!/bin/bash\n[ "$1" = bench/loader_cost.py ] && exit 0\nexec {python3} "$@"\n'
    )
    for stub in shim.iterdir():
        stub.chmod(0o755)
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "bench", tree / "bench")
    out = tmp_path / "results"
    env = {
        **os.environ,
        "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
        "WORK": str(tmp_path / "work"),
        "OUT": str(out),
        **settings,
    }
    return _bash("bench/recipe_pystd.sh", tree, env, 120), out


def test_a_failed_data_stage_is_not_marked_done(tmp_path: Path) -> None:
    work = tmp_path / "work"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # dflash
        "WORK": str(work),
        "OUT": str(tmp_path / "results"),
        "CALL_S": "300",
        "GEN_SETS": "--set bogus.field=1",
    }
    # from a copy of the scripts and configs: run in the checkout, the recipe would unpack a
    # carried target into its .carry/ (then too large to travel to the device)
    tree = tmp_path / "tree"
    for folder in ("bench", "configs"):
        shutil.copytree(ROOT / folder, tree / folder)
    done = _bash(tree / "bench" / "recipe_call.sh", tree, env, 240)
    assert done.returncode == 0, done.stderr  # the call itself ends normally, results packed
    assert "stage generate cut or failed" in done.stdout
    assert not list(work.glob("done-*")), sorted(p.name for p in work.glob("done-*"))
    assert list((tmp_path / "results").glob("call-*.tgz"))


def test_generate_attn_check_counts_identical_rows_and_speedup(tmp_path: Path) -> None:
    """bench/generate_attn_check.py: rows compared one to one, throughput read from each log."""
    import gzip
    import json

    def run(name: str, rows: list[dict], tokens_per_s: float) -> tuple[Path, Path]:
        folder = tmp_path / name
        folder.mkdir()
        lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
        (folder / "part-00000.jsonl.gz").write_bytes(gzip.compress(lines))
        log = tmp_path / f"{name}.log"
        log.write_text(f"rank 0: 1 chunks, 10 new tokens in 1.0 s ({tokens_per_s} new tokens/s)\n")
        return folder, log

    rows = [{"prompt": "a", "completion": "bcdefgh"}, {"prompt": "x", "completion": "yz"}]
    changed = [rows[0], {"prompt": "x", "completion": "yq"}]
    a = run("a", rows, 100.0)
    b = run("b", changed, 150.0)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "generate_attn_check.py"), *a, *b],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "OUT"},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["rows"], result["identical_rows"], result["speedup_b_over_a"]) == (2, 1, 1.5)
    assert 0 < result["differing_rows_mean_shared_prefix"] < 1


def test_recipe_background_follow_up_on_a_fresh_machine_says_so(tmp_path: Path) -> None:
    """A follow-up call of bench/recipe_background.sh (no .carry carried) that finds no job in
    $WORK (the machine is a fresh one) exits 4 with the reason, instead of starting a recipe
    without its model and data."""
    env = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "results")}
    done = _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)  # no .carry here
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "fresh one" in done.stdout and "start over" in done.stdout
    assert not (tmp_path / "work" / "background" / "pid").exists()


@pytest.mark.parametrize("variants", ["a|--set x=1;b|--set x=2", ""])
def test_recipe_variants_run_and_the_diagnostics_wait_finds_its_job(
    tmp_path: Path, variants: str
) -> None:
    """Side-by-side variants (VARIANTS) or the recipe alone each get a stage time, and the
    script's wait for the store diagnostics finds that job: a bare `wait` for the variants or
    for the evaluations used to reap it first, and bash then printed "not a child of this
    shell". The stages' commands are stubbed: this is the script's own control flow."""
    done, out = _stubbed_recipe(
        tmp_path, "sleep 0.5\n", STAGES="extract,train,evaluate", VARIANTS=variants
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not a child" not in done.stdout + done.stderr
    timings = (out / "timings.txt").read_text()
    for name in ("a", "b") if variants else ("recipe",):
        assert f'"{name}-train_s"' in timings and f'"{name}-evaluate_s"' in timings, timings


def test_recipe_background_runs_after_once_the_recipe_is_done(tmp_path: Path) -> None:
    """AFTER runs in the call that finds the recipe done, writes under its own $OUT, comes back
    in that call's archive, and runs once: a later call does not repeat it."""
    work, results = tmp_path / "work", tmp_path / "results"
    job = work / "background"
    (job / "results").mkdir(parents=True)
    (job / "pid").write_text("999999\n")  # finished: the exit file below says so
    (job / "exit").write_text("0\n")
    (job / "recipe.log").write_text("recipe log\n")
    (job / "results" / "warm-compile.log").write_text("...\nwarm-up failed (exit 1)\n")
    env = {
        **os.environ,
        "WORK": str(work),
        "OUT": str(results),
        "CALL_S": "110",
        "AFTER": 'echo measured > "$OUT/figure.txt"',
    }

    def call() -> subprocess.CompletedProcess:
        return _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)

    first = call()
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert "after the recipe: exit 0" in first.stdout and "recipe done" in first.stdout
    assert "warm compile: FAILED" in first.stdout  # said in every call's reply
    (archive,) = results.glob("call-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.extractfile("results/after/figure.txt")
        assert member is not None and member.read() == b"measured\n"
    archive.unlink()
    second = call()
    assert second.returncode == 0 and "after the recipe" not in second.stdout, second.stdout


def test_recipe_background_returns_the_best_drafter_while_training(tmp_path: Path) -> None:
    """A call that finds the recipe still running returns each run's export-best/ (a machine
    lost before the next call still leaves a drafter to evaluate), once per export: an
    unchanged one is not sent again, a newer one is; none with RETURN_BEST=0 (the default of
    the call that starts the recipe); and each run's metrics so far."""
    work, results = tmp_path / "work", tmp_path / "results"
    job = work / "background"
    (job / "results").mkdir(parents=True)
    (job / "pid").write_text(f"{os.getpid()}\n")  # alive, no exit file: still running
    (job / "recipe.log").write_text("training\n")
    best = work / "run-L10" / "export-best"
    best.mkdir(parents=True)
    weights = best / "model.safetensors"
    weights.write_bytes(os.urandom(4096))
    (best / "best.json").write_text('{"step": 1500, "dev_chained_tau": 3.7}\n')
    (best.parent / "metrics.jsonl").write_text('{"step": 1500, "eval_tau": 5.9}\n')
    env = {**os.environ, "WORK": str(work), "OUT": str(results), "CALL_S": "31", "POLL_S": "0.2"}

    def call() -> tuple[subprocess.CompletedProcess, list[Path]]:
        for old in results.glob("*"):
            old.unlink()
        done = _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "still running" in done.stdout
        return done, sorted(results.glob("run-L10-export-best.tar.part-*"))

    (best / "best.json").rename(best / "pending")  # exported, best.json not yet written
    _, parts = call()
    assert not parts
    (best / "pending").rename(best / "best.json")
    env["RETURN_BEST"] = "0"  # as in the call that starts the recipe: nothing sent
    held_back, parts = call()
    assert not parts and "not returned (RETURN_BEST=0" in held_back.stdout
    del env["RETURN_BEST"]

    first, parts = call()
    assert "returned run-L10/export-best" in first.stdout and parts
    (archive,) = results.glob("call-*.tgz")
    with tarfile.open(archive) as tar:  # the curve so far travels too
        member = tar.extractfile("results/L10-metrics.jsonl")
        assert member is not None and b'"eval_tau": 5.9' in member.read()
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    joined = unpacked / "joined.tar"
    joined.write_bytes(b"".join(part.read_bytes() for part in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(unpacked, filter="data")
    assert (unpacked / "run-L10" / "export-best" / "model.safetensors").read_bytes() == (
        weights.read_bytes()
    )
    second, parts = call()
    assert not parts and "returned" not in second.stdout
    stamp = weights.stat().st_mtime + 5
    os.utime(weights, (stamp, stamp))  # the trainer exported a better drafter
    third, parts = call()
    assert parts and "returned run-L10/export-best" in third.stdout
    final = best.parent / "export"  # the recipe ends: the call that sees it returns the final
    final.mkdir()
    (final / "model.safetensors").write_bytes(os.urandom(2048))
    (job / "exit").write_text("0\n")
    for old in results.glob("*"):
        old.unlink()
    done = _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)
    assert "recipe done" in done.stdout and "returned run-L10/export " in done.stdout
    assert sorted(results.glob("run-L10-export.tar.part-*"))
    assert not list(results.glob("run-L10-export-best.tar.part-*"))


def test_recipe_background_first_call_holds_its_best_drafter_back(tmp_path: Path) -> None:
    """The call that starts the recipe returns no best drafter (RETURN_BEST defaults to 0
    there: a first-minutes drafter, tens of MB before a call due within 30 s); the next call
    returns it. The recipe is a stub that exports at once and runs until told to stop;
    `python3` (the package install) and `setsid` are stubs on PATH."""
    work, results, stubs = tmp_path / "work", tmp_path / "results", tmp_path / "stubs"
    for folder in ("bench", "configs", ".carry", "stubs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "bench" / "recipe_pystd.sh").write_text(
        'best="$WORK/run-L10/export-best"; mkdir -p "$best"\n'
        'head -c 4096 /dev/urandom > "$best/model.safetensors"\n'
        'echo \'{"step": 1500}\' > "$best/best.json"\n'
        'while [ ! -f "$WORK/stop" ]; do sleep 0.2; done\n'
    )
    (stubs / "python3").write_text("#!/usr/bin/env bash\nexit 0\n")
    (stubs / "setsid").write_text('#!/usr/bin/env bash\nexec "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {
        **os.environ,
        "WORK": str(work),
        "OUT": str(results),
        "CALL_S": "33",  # watch ~3 s: the stub has exported by then
        "POLL_S": "0.2",
        "PATH": f"{stubs}:{os.environ['PATH']}",
    }
    env.pop("RETURN_BEST", None)
    try:
        first = _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)
        assert first.returncode == 0, (first.stdout, first.stderr)
        assert "started the recipe" in first.stdout and "still running" in first.stdout
        assert "not returned (RETURN_BEST=0" in first.stdout, first.stdout
        assert not list(results.glob("run-L10-export-best.tar.part-*"))
        second = _bash(ROOT / "bench" / "recipe_background.sh", tmp_path, env, 60)
        assert second.returncode == 0, (second.stdout, second.stderr)
        assert "returned run-L10/export-best" in second.stdout, second.stdout
        assert list(results.glob("run-L10-export-best.tar.part-*"))
    finally:
        work.mkdir(parents=True, exist_ok=True)
        (work / "stop").touch()


@pytest.mark.parametrize("follow", ["1", "0"])
def test_recipe_follow_trains_while_extract_writes(tmp_path: Path, follow: str) -> None:
    """FOLLOW=1: `dflash train --follow` starts while extract still runs (the store's shards
    as they are committed), and the script still waits for extract and its diagnostics and
    times every stage; without it, train starts after extract and is not told to follow. The
    stages' commands are stubbed: this is the script's own control flow."""
    calls = tmp_path / "calls.log"
    # extract waits (up to 3 s) for train to start: with FOLLOW it does, without it extract
    # ends first; an order fixed by the scripts, not by sleeps on a loaded machine
    started = tmp_path / "train.started"
    stub = (
        f'echo "$1 start $*" >> {calls}\n'
        f'[ "$1" = train ] && touch {started}\n'
        'if [ "$1" = extract ]; then\n'
        f"  for _ in $(seq 30); do [ -f {started} ] && break; sleep 0.1; done\n"
        "fi\n"
        f'echo "$1 end" >> {calls}\n'
    )
    done, out = _stubbed_recipe(tmp_path, stub, STAGES="extract,train,evaluate", FOLLOW=follow)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    order = [" ".join(line.split()[:2]) for line in lines]
    train = next(line for line in lines if line.startswith("train start"))
    if follow == "1":
        assert order.index("train start") < order.index("extract end"), order
        assert "--follow" in train and "data.follow_timeout_s=300" in train
        assert "inspect start" in order  # the diagnostics ran after extract, in its job
    else:
        assert order.index("extract end") < order.index("train start"), order
        assert "--follow" not in train
    # timings.json is written once the script has waited for every job: extract's time in it
    timings = json.loads((out / "timings.json").read_text())
    assert {"extract_s", "recipe-train_s", "recipe-evaluate_s"} <= set(timings), timings


def test_recipe_follow_reports_a_failed_extract(tmp_path: Path) -> None:
    """With FOLLOW=1 extract runs as a background job: its failure still fails the script,
    named once."""
    stub = '[ "$1" = extract ] && exit 1\nexit 0\n'
    done, _ = _stubbed_recipe(tmp_path, stub, STAGES="extract,train", FOLLOW="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed: extract (" in done.stdout, done.stdout


def test_recipe_extra_store_is_extracted_and_trained_from_by_name(tmp_path: Path) -> None:
    """STORES extracts the generated text again into $WORK/store-NAME (EXTRACT_SETS, then its own
    sets), after the main store, and inspects it; a variant's third field trains from it, the
    others from the main store. A variant naming a store STORES lacks fails the script, named,
    while the others still run. The stages' commands are stubbed: the script's own control flow."""
    calls = tmp_path / "calls.log"
    stub = f'echo "$*" >> {calls}\n'
    work = tmp_path / "work"
    done, out = _stubbed_recipe(
        tmp_path,
        stub,
        STAGES="extract,train",
        EXTRACT_SETS="--set target.tapped_layers=[1,2]",
        STORES="nv|--set store.hidden_dtype=nvfp4",
        VARIANTS="T5|--set x=1;NV5||nv;bad||nope",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed: bad (" in done.stdout and "no store nope" in done.stderr
    lines = calls.read_text().splitlines()
    extracts = [line for line in lines if line.startswith("extract ")]
    assert len(extracts) == 2, extracts
    assert f"--out {work}/store " in extracts[0] + " " and "nvfp4" not in extracts[0]
    assert f"--out {work}/store-nv " in extracts[1]
    assert extracts[1].endswith(
        "--set target.tapped_layers=[1,2] --set store.hidden_dtype=nvfp4"
    ), extracts[1]
    trains = {
        line.split("--out ")[1].split()[0]: line for line in lines if line.startswith("train ")
    }
    assert (
        f"--store {work}/store " in trains[f"{work}/run-T5"] and "x=1" in trains[f"{work}/run-T5"]
    )
    assert f"--store {work}/store-nv " in trains[f"{work}/run-NV5"]
    assert f"{work}/run-bad" not in trains
    assert any(line == f"inspect {work}/store-nv" for line in lines), lines
    assert '"extract-nv_s"' in (out / "timings.txt").read_text()
