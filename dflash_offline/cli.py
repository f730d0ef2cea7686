"""The `dflash` command: a thin Click group; each command builds its config and calls one function
(the commands live in stage_commands.py, store_commands.py and eval_commands.py).

dflash generate --config configs/debug.yaml --model PATH --data FILE --out GEN
dflash extract --config configs/debug.yaml --model PATH --data GEN --out STORE
dflash train   --config configs/debug.yaml --store STORE --out RUN
dflash inspect STORE [--sample N] [--json]
dflash inspect verify STORE
dflash plot RUN
dflash --version
"""

from __future__ import annotations

import click

from dflash_offline.eval_commands import evaluate, evaluate_offline
from dflash_offline.stage_commands import extract, generate, train
from dflash_offline.store_commands import convert, export, inspect_cmd, plot


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

    Stage 1: `generate` lets the target write its training text, `extract` runs the target
    once over it and stores what the drafter needs; stage 2: `train` trains the drafter from
    that store alone. `inspect` looks inside a store, `export` writes a drafter folder,
    `evaluate` measures its acceptance against prompt lookup (`evaluate-offline`: estimated
    from a store), `plot` redraws a run's plots, `convert` turns a store into HDF5 and back.
    `dflash COMMAND --help` describes each.
    """


for command in (generate, extract, train, inspect_cmd, export, plot, convert, evaluate):
    main.add_command(command)
main.add_command(evaluate_offline, "evaluate-offline")

if __name__ == "__main__":
    main()
