"""`dflash generate`, `dflash extract`, `dflash train`: each builds its typed config and calls
one function (run_generate, run_extract, run_train)."""

from __future__ import annotations

import click

from common.config import build_config, describe
from common.errors import cli_errors
from common.logging import init_logger, quiet_launcher_logs
from dflash_offline.options import config_options, fail


@click.command()
@config_options
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
        fail(err)


@click.command()
@config_options
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


@click.command()
@config_options
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
