"""The `dflash` command: a thin Click group; each command builds its config and calls one function.

dflash extract --config configs/debug.yaml --model PATH --data FILE --out STORE
dflash train   --config configs/debug.yaml --store STORE --out RUN
dflash inspect STORE [--sample N] [--json]
dflash inspect verify STORE
dflash plot RUN
dflash --version
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from common.config import build_config, describe
from common.errors import cli_errors
from common.logging import init_logger, quiet_launcher_logs


def _config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set packing.seq_len=4096 (repeatable; "
        "values are YAML). --help-config lists every field.",
    )(fn)
    fn = click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="YAML config file (see configs/); its section for this command is used",
    )(fn)
    return fn


def _fail(err: Exception) -> None:
    """The one-line error of a ValueError (cli_errors, on every command, does the same for
    every exception; this remains for commands that catch their own)."""
    click.echo(f"error: {err}", err=True)
    sys.exit(2)


def version_line() -> str:
    """`dflash-offline X (torch Y, transformers Z, python W)`, from the installed metadata (no
    import of torch: the answer is instant)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"dflash-offline {installed('dflash-offline')} (torch {installed('torch')}, "
        f"transformers {installed('transformers')}, python {platform.python_version()})"
    )


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_line())
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="print the versions of dflash-offline, torch and transformers and exit",
)
def main() -> None:
    """dflash-offline: train a DFlash speculative-decoding drafter for your target LLM.

    Stage 1 (`extract`) runs the target once over your data and stores what the drafter
    needs; stage 2 (`train`) trains the drafter from that store alone; `inspect` looks inside
    a store.
    """


@main.command()
@_config_options
@click.option("--model", help="target model: local folder or hub id (target.model)")
@click.option("--data", help="dataset file/folder or hub name, as for extract (data.path)")
@click.option("--out", help="folder of generated rows to write (output.out)")
@click.option("--devices", help="GPU ids like 0,1, or cpu (run.devices; default 0,1)")
@click.option(
    "--endpoint",
    help="OpenAI-compatible server URL, e.g. http://localhost:8000/v1: generate through it "
    "instead of loading the target (endpoint.url; sets run.backend=openai)",
)
@click.option("--overwrite", is_flag=True, help="delete an existing output folder first")
@click.option("--help-config", is_flag=True, help="list every config field and exit")
@cli_errors
def generate(
    config_path: str | None,
    overrides: tuple[str, ...],
    model: str | None,
    data: str | None,
    out: str | None,
    devices: str | None,
    endpoint: str | None,
    overwrite: bool,
    help_config: bool,
) -> None:
    """Let the target write its own training text: rewrite every assistant turn of chat rows
    (turn by turn, through its chat template), continue windows of text rows.

    The output folder is a dataset `dflash extract --data` reads, with the provenance (target
    fingerprint, sampling settings, source row ids) that extract copies into the store.
    Rerunning the same command after an interruption resumes it, chunk by chunk.
    """
    from stage1_generate.config import GenerateConfig

    if help_config:
        click.echo("\n".join(describe(GenerateConfig)))
        return
    flags = {
        "target.model": model,
        "data.path": data,
        "output.out": out,
        "run.devices": devices,
        "endpoint.url": endpoint,
    }
    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if endpoint:
        extra.append("run.backend=openai")
    if overwrite:
        extra.append("output.overwrite=true")
    init_logger()
    try:
        cfg = build_config(GenerateConfig, config_path, "generate", [*overrides, *extra])
        from stage1_generate.run import run_generate

        run_generate(cfg)
    except ValueError as err:
        _fail(err)


@main.command()
@_config_options
@click.option("--model", help="target model: local folder or hub id (target.model)")
@click.option("--data", help="dataset file/folder or hub name (data.path)")
@click.option("--out", help="store folder to write (store.out)")
@click.option("--devices", help="GPU ids like 0,1, or cpu (run.devices; default 0,1)")
@click.option("--overwrite", is_flag=True, help="delete an existing store at --out first")
@click.option("--help-config", is_flag=True, help="list every config field and exit")
@cli_errors
def extract(
    config_path: str | None,
    overrides: tuple[str, ...],
    model: str | None,
    data: str | None,
    out: str | None,
    devices: str | None,
    overwrite: bool,
    help_config: bool,
) -> None:
    """Run the target over a dataset once and write a Zarr v3 store of features and logits.

    Rerunning the same command after an interruption resumes where it stopped.
    """
    from stage1_extract.config import ExtractConfig

    if help_config:
        click.echo("\n".join(describe(ExtractConfig)))
        return
    flags = {"target.model": model, "data.path": data, "store.out": out, "run.devices": devices}
    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if overwrite:
        extra.append("store.overwrite=true")
    init_logger()
    quiet_launcher_logs()
    cfg = build_config(ExtractConfig, config_path, "extract", [*overrides, *extra])
    from stage1_extract.run import run_extract

    run_extract(cfg)


@main.command()
@_config_options
@click.option("--store", help="store folder written by `dflash extract` (data.store)")
@click.option("--out", help="run folder for checkpoints, metrics and the export (run.out)")
@click.option("--devices", help="GPU ids like 2,3, or cpu (run.devices; default 2,3)")
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="on a resume, apply settings that differ from the checkpoint's (lr, schedule, steps, "
    "loss) instead of refusing (run.allow_config_change)",
)
@click.option(
    "--follow",
    is_flag=True,
    help="train while `dflash extract` still writes the store: the first epoch reads shards as "
    "they are committed, waiting when it catches up (data.follow)",
)
@click.option("--help-config", is_flag=True, help="list every config field and exit")
@cli_errors
def train(
    config_path: str | None,
    overrides: tuple[str, ...],
    store: str | None,
    out: str | None,
    devices: str | None,
    allow_config_change: bool,
    follow: bool,
    help_config: bool,
) -> None:
    """Train the DFlash drafter from a store; resumes from the newest checkpoint in --out."""
    from stage2_train.config import TrainConfig

    if help_config:
        click.echo("\n".join(describe(TrainConfig)))
        return
    flags = {"data.store": store, "run.out": out, "run.devices": devices}
    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if allow_config_change:
        extra.append("run.allow_config_change=true")
    if follow:
        extra.append("data.follow=true")
    init_logger()
    quiet_launcher_logs()
    cfg = build_config(TrainConfig, config_path, "train", [*overrides, *extra])
    from stage2_train.train import run_train

    run_train(cfg)


INSPECT_USAGE = (
    "dflash inspect STORE [--sample N] [--json]  or  dflash inspect verify STORE [--json]"
)


@main.command(name="inspect")
@click.argument("args", nargs=-1, required=True, metavar="[verify] STORE")
@click.option("--sample", type=int, default=0, help="decode N sequences with loss spans marked")
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


@main.command()
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="checkpoint step (default: the newest)")
@click.option("--out", default=None, help="export folder (default: RUN/export)")
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

    click.echo(f"exported to {export_checkpoint(run, step, out, dtype)}")


@main.command()
@click.argument("run", type=click.Path(file_okay=False))
@cli_errors
def plot(run: str) -> None:
    """Redraw the PNG plots of a training run from RUN/metrics.jsonl into RUN/plots/: loss,
    per-slot held-out accuracy, held-out acceptance by draft position (training draws them at
    each evaluation)."""
    from stage2_train.plots import plot_run

    for path in plot_run(run):
        click.echo(f"wrote {path}")


@main.command()
@click.option("--target", required=True, help="target model folder or hub id")
@click.option(
    "--data",
    required=True,
    help="JSON/JSONL(.gz) of `text` documents (first tokens) or `messages` conversations (up to the last assistant turn)",
)
@click.option("--drafter", default=None, help="exported drafter folder (RUN/export)")
@click.option("--num-prompts", default=12, show_default=True, type=int)
@click.option("--prompt-tokens", default=256, show_default=True, type=int)
@click.option("--new-tokens", default=128, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda:N")
@click.option(
    "--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"])
)
@click.option("--json-out", default=None, help="also write the figures to this JSON file")
@click.option(
    "--plot",
    default=None,
    help="PNG of acceptance by draft position [default: beside --json-out, X.json -> X.png]",
)
@cli_errors
def evaluate(json_out: str | None, plot: str | None, **kwargs: Any) -> None:
    """Online acceptance length (tau) of a drafter vs prompt lookup, greedy verification:
    tau, acceptance by draft position and the histogram of accepted tokens per forward."""
    from pathlib import Path

    from evaluation.online import EvaluateConfig, run_evaluate

    if plot is None and json_out:
        plot = str(Path(json_out).with_suffix(".png"))
    init_logger()
    results = run_evaluate(EvaluateConfig(plot=plot, **kwargs))
    _echo_json(results, json_out)


def _echo_json(results: dict[str, Any], json_out: str | None) -> None:
    """Print the figures as JSON and, when asked, write them to `json_out` too."""
    import json

    text = json.dumps(results, indent=2)
    click.echo(text)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text)


@main.command("evaluate-offline")
@click.option("--drafter", required=True, help="exported drafter folder (RUN/export)")
@click.option("--store", required=True, help="a store of the same target and tapped layers")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda:N")
@click.option("--num-anchors", default=512, show_default=True, type=int, help="per sequence")
@click.option("--max-sequences", default=None, type=int, help="only the first N sequences")
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="the drafter's compute dtype (as `dflash evaluate` runs it)",
)
@click.option("--json-out", default=None, help="also write the figures to this JSON file")
@cli_errors
def evaluate_offline(json_out: str | None, **kwargs: Any) -> None:
    """Offline acceptance estimate (per-slot accuracy vs the stored target argmax, implied
    tau) of an exported drafter over every sequence of a store, with random anchors, and
    `chained_tau`: anchors chained as online decoding chains them. On a store of the target's
    own continuation of the online prompts (`dflash generate` then `dflash extract`),
    chained_tau is the online tau computed from the store."""
    from evaluation.offline import OfflineEvalConfig, run_offline_eval

    init_logger()
    results = run_offline_eval(OfflineEvalConfig(**kwargs))
    _echo_json(results, json_out)


@main.command()
@click.argument("source")
@click.argument("dest")
@click.option("--shards", help="export: shards to write, e.g. 0-3,7 [default: all committed]")
@click.option("--arrays", help="export: arrays to write, e.g. tokens,hidden,target_head [all]")
@click.option(
    "--compression",
    type=click.Choice(["gzip", "lzf", "none"]),
    help="export: h5py filter of every dataset [default: gzip]",
)
@click.option(
    "--hidden-as",
    type=click.Choice(["bits", "float32", "float16"]),
    help="export: bf16/fp8 arrays (hidden, logits, target head) as their bits with an "
    "`encoding` attribute, or decoded to floats [default: bits]",
)
@click.option("--target", help="import: target model folder (config, tokenizer, LM head)")
@click.option("--seq-len", type=int, help="import: tokens per packed sequence [3072]")
@click.option("--sequences-per-shard", type=int, help="import: sequences per shard [64]")
@click.option("--packing", type=click.Choice(["best_fit", "next_fit"]), help="import [best_fit]")
@click.option("--overlong", type=click.Choice(["split", "truncate"]), help="import [split]")
@click.option("--topk", type=int, help="import: k when top-k is computed from the head [32]")
@click.option(
    "--hidden-dtype",
    type=click.Choice(["bfloat16", "float8_e4m3fn"]),
    help="import: the store's hidden_dtype [bfloat16]",
)
@click.option("--overwrite", is_flag=True, help="import: delete an existing store at DEST first")
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
    from dflash_offline.convert import run_convert

    init_logger()
    click.echo(f"wrote {run_convert(source, dest, **options)}")


if __name__ == "__main__":
    main()
