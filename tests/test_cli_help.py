"""What `dflash --help` and each command's `--help` tell a newcomer: every command named in the
group's text and listed with an untruncated line, every option with a help text that shows its
default, and a `--set` example that is a key of that command's own config (the one example
shared by all three was extract's `packing.seq_len`, an unknown key to generate and train).
"""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner
from test_configs import REQUIRED

from common.config import build_config
from dflash_offline.cli import main as cli
from stage1_extract.config import ExtractConfig
from stage1_generate.config import GenerateConfig
from stage2_train.config import TrainConfig

CONFIGS = {"generate": GenerateConfig, "extract": ExtractConfig, "train": TrainConfig}


def _help(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("name", CONFIGS)
def test_the_set_example_is_a_key_of_the_commands_config(name: str) -> None:
    text = " ".join(_help(name).split())
    example = re.search(r"e\.g\. --set (\S+)", text)
    assert example, text
    build_config(CONFIGS[name], None, name, [*REQUIRED[name], example.group(1)])


def test_the_group_names_every_command_in_full() -> None:
    text = _help()
    listed = text.split("Commands:")[1]
    for name, command in cli.commands.items():
        assert f"`{name}`" in " ".join(text.split()), name  # the overview says what it is for
        line = next(line for line in listed.splitlines() if line.split()[:1] == [name])
        assert not line.rstrip().endswith("..."), line  # Click cut the first sentence
        assert command.short_help, name


def _options() -> list[tuple[str, click.Option]]:
    return [
        (name, param)
        for name, command in cli.commands.items()
        for param in command.params
        if isinstance(param, click.Option)
    ]


@pytest.mark.parametrize("name, option", _options(), ids=lambda v: getattr(v, "name", v))
def test_every_option_says_what_it_is_and_its_default(name: str, option: click.Option) -> None:
    assert option.help, f"dflash {name} {option.opts[0]} has no help text"
    # the value the command gets without the option (resilient: no check of required ones)
    with cli.commands[name].make_context(name, [], resilient_parsing=True) as ctx:
        default, record = ctx.params.get(option.name), option.get_help_record(ctx)
    if option.is_flag or default in (None, ()) or option.required:
        return  # a flag is off; no default: the help names the config key or the fallback
    assert record and "default:" in record[1], f"dflash {name} {option.opts[0]}: {record}"
