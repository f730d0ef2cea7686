"""A rank of `dflash generate` under torchrun that fails mid-run stops the others at their next
chunk, every rank raising its error, named; the chunks committed stay, and a rerun resumes.

Review finding: the failed rank waited in the gather at the end of the generating section
(failure_shared) while every other rank generated all its remaining chunks first (measured
under `torchrun --nproc_per_node 2` on the CPU, 1 s chunks: 9 more chunks, 11.8 s from the
failure to the exit; on a real run a whole share, hours; now 1 chunk, the one in flight, 5.0 s,
most of it torchrun's teardown). A local launch was already prompt: its launcher ends the other
processes within ~1 s of one exiting.

Review finding: a rank interrupted (Ctrl-C: KeyboardInterrupt) left the section without saying
so: under two `torchrun --nnodes 2` on one CPU host, Ctrl-C on the second node stopped its
rank while rank 0, whose torchrun does not end it, generated all its remaining chunks before
failing in the meeting with gloo's "Connection closed by peer" (as extract did,
test_review_extract_rank_failure); now it stops after the chunk in flight with `stopped: rank
1 was interrupted (Ctrl-C, SIGINT)`, exit 130.

Two gloo ranks as in test_review_rank0_sections, two scenarios in one pair of processes: rank 1
fails committing its second chunk, or is interrupted there; rank 0 (6 chunks) goes on from its
first only once rank 1 fails, then must stop within a chunk.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from test_review_rank0_sections import (
    _as_torchrun_rank,
    _in_group,
    _no_space,
    _run_ranks,
    _wait_for,
    _with_out,
    interruptible,
)

from common.config import build_config
from stage1_generate.config import GenerateConfig
from stage1_generate.run import run_generate

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
NUM_ROWS = 12  # one row a chunk: chunks 0, 2, ..., 10 are rank 0's, 1, 3, ..., 11 rank 1's


SCENARIOS = ("disk-full", "interrupted")


def _rank(rank: int, root: Path, cfg: GenerateConfig, seen: Any) -> None:
    import stage1_generate.run as generate_run

    real, committed, scenario = generate_run.write_chunk, [], ""

    def write_chunk(out: Path, chunk: int, *args: Any) -> None:
        if rank == 1 and chunk == 3:  # once rank 0 has committed its first chunk
            _wait_for(root / f"{scenario}-rank-0-committed")
            (root / f"{scenario}-rank-1-fails").touch()
            if scenario == "interrupted":  # Ctrl-C lands as it writes
                raise KeyboardInterrupt
            raise _no_space(out)
        real(out, chunk, *args)
        committed.append(chunk)
        if rank == 0 and chunk == 0:  # rank 0 goes on once rank 1 fails
            (root / f"{scenario}-rank-0-committed").touch()
            _wait_for(root / f"{scenario}-rank-1-fails")

    generate = interruptible(generate_run.run_generate)
    outcomes = {}
    with pytest.MonkeyPatch.context() as patch:
        _as_torchrun_rank(patch, rank, generate_run)
        patch.setattr(generate_run, "write_chunk", write_chunk)
        for scenario in SCENARIOS:
            committed = []
            out = _with_out(cfg, "output", root / scenario)
            outcomes[scenario] = (_in_group(root, scenario, rank, generate, out), committed)
    seen.put((rank, outcomes))


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("part-*")}


@pytest.fixture(scope="module")
def outcomes(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Any]:
    """Both scenarios run by one pair of ranks: the config, the folder of their outputs (one
    per scenario, named so) and each rank's outcome and committed chunks in each."""
    root = tmp_path_factory.mktemp("rank-failure")
    data = root / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Say {i}."},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(NUM_ROWS)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = [f"target.model={tiny_qwen3}", f"data.path={data}", "output.out=unset"]
    flags += ["run.progress=false", "sampling.max_new_tokens=4", "output.rows_per_chunk=1"]
    cfg = build_config(GenerateConfig, DEBUG, "generate", flags)
    return cfg, root, _run_ranks(_rank, root, cfg)


def test_a_failed_rank_stops_the_others_at_their_next_chunk(outcomes) -> None:
    cfg, root, seen = outcomes
    ((own, _), failed_at), ((told, seconds), committed) = seen[1]["disk-full"], seen[0]["disk-full"]
    assert failed_at == [1] and "No space left on device" in own and "RankFailed" not in own
    assert told.startswith("RankFailed: rank 1 failed") and "No space left on device" in told
    _check_stopped_then_resumed(_with_out(cfg, "output", root / "disk-full"), committed, seconds)


def test_an_interrupted_rank_stops_the_others_at_their_next_chunk(outcomes) -> None:
    cfg, root, seen = outcomes
    ((own, _), interrupted_at), ((told, seconds), committed) = (
        seen[1]["interrupted"],
        seen[0]["interrupted"],
    )
    assert interrupted_at == [1] and own == "Interrupted: KeyboardInterrupt", own
    # rank 0 does not wait in the meeting for rank 1 (gone): the process-group timeout (8 s)
    # would end it with a gloo error
    assert told.startswith("Stopped: rank 1 was interrupted (Ctrl-C, SIGINT)"), told
    _check_stopped_then_resumed(_with_out(cfg, "output", root / "interrupted"), committed, seconds)


def _check_stopped_then_resumed(cfg: GenerateConfig, committed: list[int], seconds: float) -> None:
    """Rank 0 stopped within a chunk of rank 1's failure; a rerun resumes, no row lost or
    repeated."""
    out = Path(cfg.output.out)
    # chunk 0 before rank 1 failed, chunk 2 at most (in flight then); not all six
    assert committed in ([0], [0, 2]), (committed, f"{seconds:.1f} s")

    kept = _digests(out)
    assert len(kept) == len(committed) + 1
    manifest = run_generate(cfg)  # the rerun, one process
    assert manifest["complete"] and manifest["counts"]["rows_out"] == NUM_ROWS
    assert kept.items() <= _digests(out).items()  # the committed chunks kept as they were
    source = []
    for path in sorted(out.glob("part-*.jsonl.gz")):
        source += [
            json.loads(line)["source_index"]
            for line in gzip.decompress(path.read_bytes()).splitlines()
        ]
    assert source == list(range(NUM_ROWS))  # no row lost or repeated
