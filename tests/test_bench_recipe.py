"""bench/recipe_call.sh marks a data stage done only when it succeeded: a stage that fails (here
`dflash generate` refusing an unknown setting, in a second) is rerun by the next call, and the
stages after it do not run on its missing output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "recipe_call.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr  # the call itself ends normally, results packed
    assert "stage generate cut or failed" in done.stdout
    assert not list(work.glob("done-*")), sorted(p.name for p in work.glob("done-*"))
    assert list((tmp_path / "results").glob("call-*.tgz"))
