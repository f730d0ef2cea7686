"""`dflash generate`, `dflash extract`, `dflash train`: each builds its typed config and calls
one function (run_generate, run_extract, run_train)."""

from __future__ import annotations

import click

from common.config import build_config
from common.errors import cli_errors
from common.logging import init_logger, quiet_launcher_logs
from dflash_offline.options import config_options, help_config_option
from stage1_extract.config import ExtractConfig
from stage1_generate.config import GenerateConfig
from stage2_train.config import TrainConfig


def _model_name(model: str | None) -> str:
    """The target as the user gave it, for the errors that name it: the flag when typed (it
    overrides the config), else the config key from --config or --set."""
    return "--model" if model is not None else "target.model"


@click.command(short_help="Let the target write its own training text (stage 1).")
@config_options("sampling.max_new_tokens=2048")
@click.option(
    "--model",
    "--target",
    "model",
    help="target model: local folder or hub id (target.model)",
)
@click.option("--data", help="dataset file/folder or hub name, as for extract (data.path)")
@click.option("--out", help="folder of generated rows to write (output.out)")
@click.option("--devices", help="GPU ids like 0,1, or cpu (run.devices; default 0,1)")
@click.option(
    "--endpoint",
    help="OpenAI-compatible server URL, e.g. http://localhost:8000/v1: generate through it "
    "instead of loading the target (endpoint.url; sets run.backend=openai)",
)
@click.option(
    "--overwrite", is_flag=True, help="delete an existing folder at --out first (output.overwrite)"
)
@click.option(
    "--server-sampling",
    is_flag=True,
    help="write the text as vLLM and SGLang serve a request that sets no sampling: "
    "sampling.temperature, top_p, top_k and repetition_penalty from the target's "
    "generation_config.json where it sets them, else the servers' defaults (temperature 1.0, "
    "every token, no penalty); over the config file, under --set sampling.* given beside it",
)
@help_config_option(GenerateConfig)
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
    server_sampling: bool,
) -> None:
    """Let the target write its own training text: rewrite every assistant turn of chat rows
    (turn by turn, through its chat template), continue windows of text rows.

    The output folder is a dataset `dflash extract --data` reads, with the provenance (target
    fingerprint, sampling settings, source row ids) that extract copies into the store.
    Rerunning the same command after an interruption resumes it, chunk by chunk.
    """
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
    cfg = build_config(GenerateConfig, config_path, "generate", [*overrides, *extra])
    if server_sampling:
        cfg = _with_served_sampling(cfg, config_path, [*overrides, *extra])
    from stage1_generate.run import run_generate

    run_generate(cfg, _model_name(model))


def _with_served_sampling(
    cfg: GenerateConfig, config_path: str | None, sets: list[str]
) -> GenerateConfig:
    """`cfg` rebuilt with the served sampling (common.served_sampling) set over the config
    file and under `sets` (the user's --set and flags, applied after it)."""
    from common.served_sampling import log_served, served_sampling

    served = served_sampling(cfg.target.model)
    served_sets = [f"sampling.{key}={value}" for key, value in served.items()]
    cfg = build_config(GenerateConfig, config_path, "generate", [*served_sets, *sets])
    log_served({key: getattr(cfg.sampling, key) for key in served})
    return cfg


@click.command(short_help="Write a store of the target's features (stage 1).")
@config_options("packing.seq_len=4096")
@click.option(
    "--model",
    "--target",
    "model",
    help="target model: local folder or hub id (target.model)",
)
@click.option(
    "--data", help="dataset file/folder or hub name, e.g. a `dflash generate` output (data.path)"
)
@click.option("--out", help="store folder to write (store.out)")
@click.option("--devices", help="GPU ids like 0,1, or cpu (run.devices; default 0,1)")
@click.option(
    "--overwrite", is_flag=True, help="delete an existing store at --out first (store.overwrite)"
)
@help_config_option(ExtractConfig)
@cli_errors
def extract(
    config_path: str | None,
    overrides: tuple[str, ...],
    model: str | None,
    data: str | None,
    out: str | None,
    devices: str | None,
    overwrite: bool,
) -> None:
    """Run the target over a dataset once and write a Zarr v3 store of features and logits.

    Rerunning the same command after an interruption resumes where it stopped.
    """
    flags = {"target.model": model, "data.path": data, "store.out": out, "run.devices": devices}
    extra = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if overwrite:
        extra.append("store.overwrite=true")
    init_logger()
    quiet_launcher_logs()
    cfg = build_config(ExtractConfig, config_path, "extract", [*overrides, *extra])
    from stage1_extract.run import run_extract

    run_extract(cfg, _model_name(model))


@click.command(short_help="Train the drafter from a store (stage 2).")
@config_options("optim.lr=3e-4")
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
@help_config_option(TrainConfig)
@cli_errors
def train(
    config_path: str | None,
    overrides: tuple[str, ...],
    store: str | None,
    out: str | None,
    devices: str | None,
    allow_config_change: bool,
    follow: bool,
) -> None:
    """Train the DFlash drafter from a store; resumes from the newest checkpoint in --out.

    SIGTERM, a first Ctrl-C or run.time_limit_s stop it after the step in flight, with a
    checkpoint of that step (exit 143 / 130 / 124): rerun the same command to resume."""
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
