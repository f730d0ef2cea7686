"""Shared pieces of the `dflash` commands: the config options, the checked --device, JSON output."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from common.config import describe
from common.errors import INTERRUPT_EXIT


def config_options(example: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--config FILE` and `--set KEY=VALUE`; `example` is a KEY=VALUE of the command's own
    config (each command has its own sections: another's key is an error there)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option(
            "--set",
            "overrides",
            multiple=True,
            metavar="KEY=VALUE",
            help=f"override any config field, e.g. --set {example} (repeatable; values are "
            "YAML). --help-config lists every field.",
        )(fn)
        return click.option(
            "--config",
            "config_path",
            type=click.Path(dir_okay=False),
            default=None,
            help="YAML config file (see configs/); its section for this command is used; "
            "without one, the defaults --help-config lists",
        )(fn)

    return decorate


def help_config_option(config_class: type) -> Callable[..., Any]:
    """`--help-config`: list every field of the command's config and exit."""

    def show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo("\n".join(describe(config_class)))
            ctx.exit()

    return click.option(
        "--help-config",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=show,
        help="list every config field and exit",
    )


def device_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--device cpu|cuda:N`, checked as it is parsed: torch's own errors for a GPU that is not
    there ("Torch not compiled with CUDA enabled", an AssertionError) or a name it does not
    know come out of the first tensor moved, as a bug, after the weights load."""
    return click.option(
        "--device",
        default="cpu",
        show_default=True,
        callback=_check_device,
        help="cpu or cuda:N",
    )(fn)


def _check_device(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    import torch

    try:
        device = torch.device(value)
    except RuntimeError as err:
        raise click.BadParameter(f"{value!r} is not a device; pass cpu or cuda:N") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise click.BadParameter(f"{value}: this machine has no CUDA GPU; pass cpu")
        if (device.index or 0) >= count:
            raise click.BadParameter(
                f"{value}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return value


def check_out_file(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file written once the work is done (--json-out, --plot), checked as it is parsed: a
    folder there, or a file where a folder of its path goes, failed only after all of the work
    (minutes), and evaluate had written its plot beside that path by then."""
    if value is None:
        return value
    path, example = Path(value), "acceptance.png" if param.name == "plot" else "figures.json"
    if path.is_dir():
        raise click.BadParameter(
            f"{value} is a folder; pass a file to write, e.g. {path / example}"
        )
    above = next((folder for folder in path.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise click.BadParameter(
            f"{value}: {above} is a file, not a folder; pass a path in a folder"
        )
    if param.name == "plot":
        _check_image_suffix(path)
    return value


def plot_beside(json_out: str) -> str:
    """The plot `dflash evaluate` draws beside --json-out X.json when no --plot is given (X.png),
    checked before the work as --plot is: a folder there failed only once every prompt was
    measured, with the figures neither printed nor written."""
    plot = Path(json_out).with_suffix(".png")
    if plot.is_dir():
        raise click.BadParameter(
            f"{json_out} draws its plot beside it, at {plot}, which is a folder; pass --plot "
            f"FILE to draw it elsewhere (e.g. {plot / 'acceptance.png'}), or move that folder",
            param_hint="'--json-out'",
        )
    return str(plot)


def _check_image_suffix(path: Path) -> None:
    """matplotlib picks the format by the suffix: an unknown one failed after the work, with
    the figures unwritten, and none wrote PATH.png where the log named PATH."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # evaluate warns that it draws no plot
        return
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise click.BadParameter(
            f"{path}: matplotlib writes no {path.suffix or 'suffix-less'} file; end it in one of "
            f".{', .'.join(sorted(formats))}, e.g. {path.with_suffix('.png')}"
        )


def echo_json(results: dict[str, Any], json_out: str | None) -> None:
    """Print the figures as JSON and, when asked, write them to `json_out` too."""
    import json

    # NaN (e.g. a loss over zero labelled slots) is not JSON: null keeps the file readable
    text = json.dumps(_finite(results), indent=2, allow_nan=False)
    click.echo(text)
    if json_out:
        # its folder made as the plot beside it makes its own: evaluate-offline's --json-out in
        # a new folder failed after all of its work (minutes on a CPU), evaluate's did not
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        with open(json_out, "w") as f:
            f.write(text)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None, through dicts and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def exit_interrupted(kept: str) -> NoReturn:
    """Exit on Ctrl-C as `cli_errors` does (130, `interrupted (Ctrl-C): ...`), saying what stays
    of the work: for the commands its RESUME_HINTS does not name."""
    import logging

    click.echo(f"interrupted (Ctrl-C): {kept}", err=True)
    logging.shutdown()
    raise SystemExit(INTERRUPT_EXIT)
