"""`run.export_best`: the drafter at its best `dev_chained_tau` so far, exported when reached.

The dev chained tau (`data.dev_store`) is the online tau computed offline, prompt by prompt,
and a run that overfits its data peaks before its last step (BENCHMARKS.md: pystd-28m flat
from step 7,500 of 10,000). So each evaluation that beats the best so far exports the drafter
to RUN/export-best/ (the same files as RUN/export/, which stays the final drafter) with
best.json beside them, in the same rename: its step, its figure, and the dev store that figure
is of (its path and content key).

A run, resumed or rerun, starts from best.json as it finds it, whatever its step: a run killed
after exporting a best and before its next checkpoint redoes those steps, and the drafter on
disk stays until an evaluation beats it, so export-best/ only ever improves within a run folder
(checkpoints hold no best: best.json is the one record of it). An export-best/ that a kill left
only as `.tmp-old-export-best` (between the two renames of a replace that could not swap the
folders, common/durable.py) is renamed back first, not taken for no best. A figure is compared only with
figures of the same dev store (`data.dev_store` may change on a resume) and of the same
definition (`dev_definition`: the measure, block size and stop ids; a later version may measure
otherwise): a record of another content key or definition starts the comparison afresh, said
in the log, and the first evaluation replaces export-best/. A best.json written before the
definition was recorded is read as before. A best.json written before the dev store was recorded names none;
it is taken as the current dev store's (the common case: a dev store is rarely swapped
mid-run), said in the log with the way out (delete best.json to start afresh), rather than let
a worse drafter replace it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from common.durable import aside_name, recover_aside
from common.logging import get_logger

BEST_DIR = "export-best"
BEST_FILE = "best.json"
# what the dev figure is, recorded in best.json (`dev_definition`): figures compare only under
# one definition. Raise the version when chained_tau_on_store comes to measure otherwise (what
# counts as accepted, how anchors chain), not when it only runs faster
DEV_MEASURE = {
    "measure": "chained_tau",
    "version": 1,
    "drafter": "bf16 weights computing in fp32, the target head in fp32",
}


def dev_definition(block_size: int, stop_ids: Iterable[int]) -> dict[str, Any]:
    """How the dev figure is defined: the measure and how the drafter runs for it, the block
    size it drafts and the ids a reply's stop is counted by (`unstored_stop_ids` of the dev
    store: the same store under another rule, such as generate's recorded stop ids, differs)."""
    return DEV_MEASURE | {"block_size": block_size, "stop_ids": sorted(stop_ids)}


def best_so_far(out: Path, dev_store: str, dev_key: str, definition: dict[str, Any]) -> float:
    """The dev_chained_tau that RUN/export-best/best.json records for the dev store of content
    key `dev_key` (at `dev_store`) under `definition` (`dev_definition`), or -inf: none yet,
    unreadable, another dev store's or defined otherwise (a record without a definition, from
    before it was recorded, is taken as this one's)."""
    path = out / BEST_DIR / BEST_FILE
    log = get_logger()
    # (the run folder's lock is held: no export-best/ is being replaced under us)
    if recover_aside(path.parent):
        log.info(
            "export-best: renamed %s back to %s (a killed export had moved it aside)",
            aside_name(path.parent).name,
            path.parent,
        )
    if not path.exists():
        return -math.inf
    try:
        record = json.loads(path.read_text())
        step, tau = int(record["step"]), float(record["dev_chained_tau"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning(
            "export-best: %s is unreadable (%s): the best figure starts afresh, and the first "
            "evaluation replaces export-best/",
            path,
            err,
        )
        return -math.inf
    recorded = record.get("dev_store_content_key")
    if recorded is None:
        log.info(
            "export-best: best.json's dev_chained_tau %.4f (step %d) names no dev store (written "
            "before that record): taken as data.dev_store %s's; delete %s to start afresh",
            tau,
            step,
            dev_store,
            path,
        )
    elif recorded != dev_key:
        log.info(
            "export-best: best.json's dev_chained_tau %.4f (step %d) is of another dev store "
            "(%s, content key %s), not data.dev_store %s (content key %s): the best figure "
            "starts afresh on this store, and its first evaluation replaces export-best/",
            tau,
            step,
            record.get("dev_store"),
            recorded,
            dev_store,
            dev_key,
        )
        return -math.inf
    recorded_definition = record.get("definition")
    if recorded_definition is not None and recorded_definition != _as_json(definition):
        log.info(
            "export-best: best.json's dev_chained_tau %.4f (step %d) was defined otherwise (%s), "
            "not as this run measures it (%s): the best figure starts afresh, and the first "
            "evaluation replaces export-best/",
            tau,
            step,
            json.dumps(recorded_definition),
            json.dumps(definition),
        )
        return -math.inf
    if recorded is not None:
        log.info(
            "export-best: the best so far is dev_chained_tau %.4f at step %d (best.json); only "
            "an evaluation above it replaces export-best/",
            tau,
            step,
        )
    return tau


def _as_json(value: Any) -> Any:
    """`value` as best.json reads back (tuples as lists)."""
    return json.loads(json.dumps(value))


def best_record(
    step: int, tau: float, dev_store: str, dev_key: str, definition: dict[str, Any]
) -> str:
    """best.json's text: the step, its figure, the dev store (path, content key) that figure
    is of and how it is defined (`dev_definition`). Written into export-best/ with the drafter, in the export's one rename
    (`export_drafter`'s extra_files): a kill between the two left a drafter without its record,
    which the next run took for no best and replaced at its first evaluation, a worse one too."""
    record = {
        "step": step,
        "dev_chained_tau": tau,
        "dev_store": dev_store,
        "dev_store_content_key": dev_key,
        "definition": definition,
    }
    return json.dumps(record) + "\n"
