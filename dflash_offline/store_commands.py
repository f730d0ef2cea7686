"""`dflash inspect`, `dflash export`, `dflash plot`, `dflash convert`: reading and converting
what the stages wrote."""

from __future__ import annotations

import sys
from typing import Any

import click

from common.errors import cli_errors
from common.logging import init_logger
from dflash_offline.options import exit_interrupted

INSPECT_USAGE = (
    "dflash inspect STORE [--sample N] [--json]  or  dflash inspect verify STORE [--json]"
)


@click.command(name="inspect", short_help="Summarise a store, decode samples, or verify it.")
@click.argument("args", nargs=-1, required=True, metavar="[verify] STORE")
@click.option(
    "--sample",
    type=int,
    default=0,
    show_default=True,
    metavar="N",
    help="decode N sequences with loss spans marked",
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@cli_errors
def inspect_cmd(args: tuple[str, ...], sample: int, as_json: bool) -> None:
    """Summarise a store, decode samples, or `verify` every shard (exit 1 on problems).

    \b
    dflash inspect STORE [--sample N] [--json]   summary (and N decoded sequences)
    dflash inspect verify STORE [--json]         check every shard against FORMAT.md

    `verify` comes before the store.
    """
    from common.inspect_store import run_inspect, run_verify

    if args[0] == "verify":
        if len(args) != 2:
            raise ValueError("usage: dflash inspect verify STORE [--json] (one store)")
        if sample:  # verify decodes nothing: the option was dropped without a word
            raise ValueError(
                f"--sample {sample} decodes sequences in the summary, not in verify: run "
                f"`dflash inspect {args[1]} --sample {sample}` for them"
            )
        sys.exit(0 if run_verify(args[1], as_json=as_json) else 1)
    if len(args) != 1:
        raise ValueError(_inspect_misuse(args))
    run_inspect(args[0], num_samples=sample, as_json=as_json)


def _inspect_misuse(args: tuple[str, ...]) -> str:
    """The error for arguments that fit neither form: the command meant when it is clear
    (`inspect STORE verify` is a common slip), else both forms."""
    if len(args) == 2 and args[1] == "verify":
        return f"`verify` goes before the store: run `dflash inspect verify {args[0]}`"
    return f"expected one store, got {' '.join(args)!r}; usage: {INSPECT_USAGE}"


@click.command(short_help="Export a training checkpoint as a drafter folder.")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="checkpoint step [default: the newest]")
@click.option("--out", default=None, help="export folder [default: RUN/export]")
@click.option(
    "--dtype",
    default="bfloat16",
    show_default=True,
    type=click.Choice(["bfloat16", "float32", "float16"]),
    help="dtype of the exported weights",
)
@cli_errors
def export(run: str, step: int | None, out: str | None, dtype: str) -> None:
    """Export a checkpoint of a training run as a transformers-style drafter folder."""
    from stage2_train.export import export_checkpoint

    init_logger()  # its renames and warnings (a last layer tapped, a mask token) as train's
    click.echo(f"exported to {export_checkpoint(run, step, out, dtype)}")


@click.command(short_help="Redraw the PNG plots of a training run.")
@click.argument("run", type=click.Path(file_okay=False))
@cli_errors
def plot(run: str) -> None:
    """Redraw the PNG plots of a training run from RUN/metrics.jsonl into RUN/plots/: loss,
    per-slot held-out accuracy, held-out acceptance by draft position (training draws them at
    each evaluation)."""
    from stage2_train.plots import plot_run

    init_logger()  # a plot that cannot be drawn is a warning
    for path in plot_run(run):
        click.echo(f"wrote {path}")


@click.command(short_help="Convert a store to one HDF5 file, or HDF5 to a store.")
@click.argument("source")
@click.argument("dest")
@click.option("--shards", help="export: shards to write, e.g. 0-3,7 [default: all committed]")
@click.option(
    "--arrays", help="export: arrays to write, e.g. tokens,hidden,target_head [default: all]"
)
@click.option(
    "--compression",
    type=click.Choice(["gzip", "lzf", "none"]),
    help="export: h5py filter of every dataset [default: gzip]",
)
@click.option(
    "--hidden-as",
    type=click.Choice(["bits", "float32", "float16"]),
    help="export: bf16 / fp8 / nvfp4 arrays (hidden, logits, target head) as stored, with an "
    "`encoding` attribute, or decoded to floats [default: bits]",
)
@click.option(
    "--target",
    "--model",
    "target",
    help="import: target model folder (config, tokenizer, LM head) [default: the file's root "
    "attribute target, else its target_config and /target_head]",
)
@click.option("--seq-len", type=int, help="import: tokens per packed sequence [default: 3072]")
@click.option("--sequences-per-shard", type=int, help="import: sequences per shard [default: 64]")
@click.option(
    "--packing",
    type=click.Choice(["best_fit", "next_fit"]),
    help="import: how documents fill sequences, as extract's packing.strategy [default: best_fit]",
)
@click.option(
    "--overlong",
    type=click.Choice(["split", "truncate"]),
    help="import: documents longer than --seq-len, as extract's packing.overlong [default: split]",
)
@click.option(
    "--topk", type=int, help="import: k when top-k is computed from the head [default: 32]"
)
@click.option(
    "--hidden-dtype",
    type=click.Choice(["bfloat16", "float8_e4m3fn", "nvfp4"]),
    help="import: the store's hidden_dtype [default: bfloat16]",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="replace an existing DEST (export: the HDF5 file; import: the store, deleted first)",
)
@cli_errors
def convert(source: str, dest: str, **options: Any) -> None:
    """Convert a store to one HDF5 file, or an HDF5 file of documents to a store.

    \b
    dflash convert STORE OUT.h5 [--shards 0-3,7] [--arrays tokens,hidden] [--compression lzf]
    dflash convert IN.h5 STORE [--target MODEL_FOLDER] [--seq-len 3072]

    The direction follows SOURCE: a store folder is exported, a file imported (rerun the same
    import to resume it). FORMAT.md, "HDF5 files", describes both layouts; an import without
    verifier outputs computes them from the LM head when the target's last layer is tapped,
    else uses the data's next token (as `loss.target=data` does).
    """
    from pathlib import Path

    from dflash_offline.convert import run_convert

    init_logger()
    try:
        click.echo(f"wrote {run_convert(source, dest, **options)}")
    except KeyboardInterrupt:  # what stays, as generate's and extract's Ctrl-C say it
        kept = (
            f"nothing was written to {dest} (the file is written under a temporary name)"
            if Path(source).is_dir()
            else f"the shards committed to {dest} so far stay; rerun the same command to resume"
        )
        exit_interrupted(kept)
