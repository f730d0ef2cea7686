"""What README.md and FORMAT.md tell a user to type exists: every config key they name in
backticks, after `--set` or in a shell example's comment is a key of its command's config (a
key of a section several stages share: of one of them), every `dflash <command>` is a command,
every `--flag` shown with one is that command's own (as its `--help` lists it, read from the
Click objects in-process), a flag shown alone is an option of a command its paragraph, list item
or heading names, a value shown is one the key or flag takes, and every config file named
(`configs/pystd.yaml`, `debug.yaml`) loads. BENCHMARKS.md keeps the prose of its time, so only
its `dflash` commands are checked.

Run: pytest tests/test_readme_names.py (a few seconds).
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest

from common.config import _coerce, _field_type, build_config, describe, parse_overrides
from dflash_offline.cli import main
from stage1_extract.config import ExtractConfig
from stage1_generate.config import GenerateConfig
from stage2_train.config import TrainConfig

ROOT = Path(__file__).parent.parent
COMMAND_CONFIGS: dict[str, type] = {
    "generate": GenerateConfig,
    "extract": ExtractConfig,
    "train": TrainConfig,
}
# the fields a command needs before its config validates (as in tests/test_configs.py)
REQUIRED = {
    "generate": ["target.model=m", "data.path=d", "output.out=o"],
    "extract": ["target.model=m", "data.path=d", "store.out=o"],
    "train": ["data.store=s", "run.out=o"],
}

# Dotted names in the docs' backticks that are not config keys, each with what it is. A name
# here is never checked, so no config key may be listed (test_the_allow_lists_hide_nothing).
NOT_CONFIG_KEYS = {
    "AutoModel.from_pretrained": "transformers' loader of the exported drafter (README)",
    "dflash_config.mask_token": "a field of the exported config.json (README)",
    "attributes.dflash": "where the store's root attributes sit in zarr.json (FORMAT.md)",
    "content.text": "a field of a generated folder's provenance (FORMAT.md)",
    "content.sampling": "a field of a generated folder's provenance (FORMAT.md)",
    "dataset.format": "a store root attribute, the data's provenance (FORMAT.md)",
    "bits.astype": "numpy, decoding bf16 bits of an HDF5 export (FORMAT.md)",
    "embed_tokens.weight": "a tensor of the target head file (FORMAT.md)",
    "norm.weight": "a tensor of the target head file (FORMAT.md)",
    "lm_head.weight": "a tensor of the target head file (FORMAT.md)",
}
# Flags shown alone in backticks that belong to a bench script, not to a `dflash` command.
OTHER_PROGRAMS_FLAGS = {
    "--sweep": "bench/bench_attention.py (README, Attention)",
    "--fresh-cache": "bench/bench_attention.py (README, Attention)",
}
# A dotted name ending in one of these is a file (`config.json`, `store.py`, `OUT.h5`).
FILE_SUFFIXES = {"gz", "h5", "json", "jsonl", "md", "parquet", "png", "py", "safetensors"}
FILE_SUFFIXES |= {"sh", "yaml"}

DOTTED = re.compile(r"(?<![\w./=$-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
ASSIGNMENT = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)=(.*)")
SECTION_WILDCARD = re.compile(r"(?<![\w./=-])([A-Za-z_]\w*)\.\*")
SET_KEY = re.compile(r"--set\s+['\"]?([^\s'\"`=]+)")
FLAG = re.compile(r"^\[?(--?[A-Za-z][\w-]*)")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|\.\.\.|\$\w+|)$")  # `=N`, `--model M`, `$DOCS`


def config_keys(cls: type) -> set[str]:
    """Every key of a config, its sections included: `run`, `run.out`, ..."""
    return {line.split(" ")[0].rstrip(":") for line in describe(cls)}


def command_options(command: click.Command) -> dict[str, click.Option]:
    """The flags `--help` lists for `command`: every option's names, `--no-x` forms, -h."""
    ctx = click.Context(command, info_name=command.name)
    params = [p for p in command.get_params(ctx) if isinstance(p, click.Option)]
    return {name: p for p in params for name in (*p.opts, *p.secondary_opts)}


KEYS = {name: config_keys(cls) for name, cls in COMMAND_CONFIGS.items()}
SECTIONS = {key for keys in KEYS.values() for key in keys if "." not in key}
GROUP = "(the dflash group)"
OPTIONS = {name: command_options(cmd) for name, cmd in main.commands.items()}
OPTIONS[GROUP] = command_options(main)


@dataclass
class Snippet:
    """A unit of a doc: an inline code span, a shell command or a shell comment."""

    text: str
    line: int
    kind: str  # "span", "command" or "comment"
    # span: the `dflash` commands its paragraph or list item names (its flags shown alone are one
    # of theirs)
    commands: list[str] = field(default_factory=list)


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)  # everything checked, to test the extraction
    flags: set[str] = field(default_factory=set)
    commands: set[str] = field(default_factory=set)

    def add(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")


def words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an apostrophe in a comment
        return text.split()


def dflash_command(text: str) -> str | None:
    """`generate` for a span `dflash generate ...`; None for a group flag or no command."""
    tokens = words(text)
    if len(tokens) >= 2 and tokens[0] == "dflash" and not tokens[1].startswith("-"):
        return tokens[1]
    return None


def snippets(text: str) -> list[Snippet]:
    """The inline code spans of the prose (a span may wrap over lines, not past a paragraph, a
    list item or a table row), and the commands and comments of ```bash fences. A span's
    `commands` are those its unit and the heading above it name."""
    out: list[Snippet] = []
    unit: list[tuple[int, str]] = []
    heading: list[str] = []

    def close_unit() -> None:
        joined = "\n".join(line for _, line in unit)
        if joined.count("`") % 2:
            raise AssertionError(f"line {unit[0][0]}: unbalanced backticks")
        spans = [
            (" ".join(m.group(1).split()), unit[0][0] + joined.count("\n", 0, m.start()))
            for m in re.finditer(r"`([^`]+)`", joined)
        ]
        named = [c for span, _ in spans for c in (dflash_command(span) or "").split("|") if c]
        if unit[0][1].startswith("#"):
            heading[:] = named
        out.extend(Snippet(span, line, "span", named + heading) for span, line in spans)
        unit.clear()

    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            if unit and not line.startswith(" "):  # a fence indented into a list item is in it
                close_unit()
            shell = line.strip().strip("`").strip() in ("bash", "sh", "shell")
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                start, command = i + 1, lines[i]
                while command.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command.rstrip()[:-1] + " " + lines[i].strip()
                if shell:
                    out += shell_snippets(command, start)
                i += 1
        elif not line.strip() or re.match(r"\s*(- |\d+\. |\||#)", line):
            if unit:
                close_unit()
            if line.strip():
                unit.append((i + 1, line))
        else:
            unit.append((i + 1, line))
        i += 1
    if unit:
        close_unit()
    return out


def shell_snippets(line_text: str, line: int) -> list[Snippet]:
    """A shell line as its commands (split at &&, ;, |, a trailing &) and its comment."""
    match = re.search(r"(?:^|\s)#", line_text)
    code, comment = (
        (line_text[: match.start()], line_text[match.end() :]) if match else (line_text, "")
    )
    out = [Snippet(comment.strip(), line, "comment")] if comment.strip() else []
    for part in re.split(r"&&|\|\||;|\||&\s*$", code):
        if part.strip():
            out.append(Snippet(" ".join(part.split()), line, "command"))
    return out


def check_key(key: str, value: str | None, configs: list[str], where: str, report: Report) -> None:
    """`key` is a key of one of `configs` and `value` (unless a placeholder) is valid for it."""
    report.keys.add(key)
    found = [name for name in configs if key in KEYS[name]]
    if not found:
        section = key.split(".")[0]
        if section not in SECTIONS:
            report.add(where, f"`{key}`: {section!r} is no config section (nor in NOT_CONFIG_KEYS)")
        else:
            report.add(where, f"`{key}` is no key of the {'/'.join(configs)} config")
        return
    if value is None or PLACEHOLDER.match(value):
        return
    errors = []
    for name in found:
        cls = COMMAND_CONFIGS[name]
        try:
            parsed = parse_overrides([f"{key}={value}"], cls)
            for part in key.split("."):
                parsed = parsed[part]
            _coerce(parsed, _field_type(cls, key), key)
            return
        except ValueError as err:
            errors.append(str(err))
    report.add(where, f"`{key}={value}`: {errors[0]}")


def check_config_file(path: str, commands: list[str], where: str, report: Report) -> None:
    """A `configs/*.yaml` named in a doc exists and loads for each of `commands`."""
    for command in commands:
        problem = config_file_problem(path, command)
        if problem:
            report.add(where, problem)


@functools.cache
def config_file_problem(path: str, command: str) -> str | None:
    if not (ROOT / path).is_file():
        return f"{path} does not exist"
    try:
        build_config(COMMAND_CONFIGS[command], ROOT / path, command, REQUIRED[command])
    except ValueError as err:
        return f"{path} does not load for `dflash {command}`: {err}"
    return None


def flags_shown(tokens: list[str], report: Report) -> Iterator[tuple[str, str]]:
    """(flag, the token after it or "") for each flag in `tokens`, each counted as seen."""
    for i, token in enumerate(tokens):
        if match := FLAG.match(token):
            report.flags.add(match.group(1))
            yield match.group(1), tokens[i + 1] if i + 1 < len(tokens) else ""


def check_flags(tokens: list[str], command: str, where: str, report: Report) -> None:
    """The flags in `tokens` are `command`'s; a choice's values (`--dtype a|b`) are its choices;
    the key after --set is of its config and --config's file loads."""
    options = OPTIONS[command]
    for flag, after in flags_shown(tokens, report):
        if flag not in options:
            report.add(where, f"`{flag}` is no option of `dflash {command}`")
            continue
        value = after.strip("[]")
        choice = options[flag].type
        if isinstance(choice, click.Choice) and not PLACEHOLDER.match(value):
            for v in value.split("|"):
                if v not in choice.choices:
                    report.add(where, f"`{flag} {v}`: `dflash {command}` takes {choice.choices}")
        if flag == "--set" and command in COMMAND_CONFIGS:
            key, eq, setting = value.partition("=")
            check_key(key, setting if eq else None, [command], where, report)
        if flag == "--config" and value.startswith("configs/"):
            check_config_file(value, [command], where, report)


def check_dflash(tokens: list[str], where: str, report: Report) -> list[str]:
    """`dflash <command> ...` (or `dflash a|b|c ...`): each command exists and takes the flags
    shown. Returns the commands."""
    if len(tokens) < 2:
        return []
    if tokens[1].startswith("-"):
        check_flags(tokens[1:], GROUP, where, report)
        return []
    commands = tokens[1].split("|")
    for command in commands:
        if command not in main.commands:
            report.add(where, f"`dflash {command}` is no command ({sorted(main.commands)})")
            continue
        report.commands.add(command)
        check_flags(tokens[2:], command, where, report)
    return [c for c in commands if c in main.commands]


def check_dotted(text: str, configs: list[str], where: str, report: Report, strict: bool) -> None:
    """Each dotted name in `text` is a key of one of `configs`, a file or in NOT_CONFIG_KEYS;
    `strict=False` (comments, which are prose) checks only names that start with a section."""
    for token in words(text):
        token = token.strip("'\"").lstrip("([").rstrip("),;:")
        while token.endswith("]") and token.count("]") > token.count("["):  # [--shards 0-3]
            token = token[:-1]
        assignment = ASSIGNMENT.fullmatch(token)
        if assignment:
            names = [(assignment.group(1), assignment.group(2))]
        else:
            names = [(m.group(1), None) for m in DOTTED.finditer(token)]
            for m in SECTION_WILDCARD.finditer(token):
                report.keys.add(m.group(1) + ".*")
                if m.group(1) not in SECTIONS:
                    report.add(where, f"`{m.group(1)}.*`: {m.group(1)!r} is no config section")
        for name, value in names:
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES or name in NOT_CONFIG_KEYS:
                continue
            if strict or name.split(".")[0] in SECTIONS:
                check_key(name, value, configs, where, report)


def check_doc(text: str, name: str, commands_only: bool = False) -> Report:
    """Every problem with the names `text` shows a user; `commands_only`: its `dflash`
    commands alone."""
    report = Report()
    every_config = list(COMMAND_CONFIGS)
    for snippet in snippets(text):
        where = f"{name}:{snippet.line}"
        tokens = words(snippet.text)
        while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # FOLLOW=1 bash ...
            tokens = tokens[1:]
        if not tokens:
            continue
        commands = check_dflash(tokens, where, report) if tokens[0] == "dflash" else []
        if commands_only:
            continue
        configs = [c for c in commands if c in COMMAND_CONFIGS] or every_config
        if snippet.kind == "command" and tokens[0] != "dflash":
            # another program (bash, torchrun, python bench/...): only its --set keys are ours
            for m in SET_KEY.finditer(snippet.text):
                check_key(m.group(1), None, every_config, where, report)
            continue
        check_dotted(snippet.text, configs, where, report, strict=snippet.kind == "span")
        if snippet.kind == "span" and tokens[0].startswith("--"):
            # flags shown alone (`--json-out X.json`): of a command the paragraph names
            check_alone(tokens, snippet.commands, where, report)
        for path in re.findall(r"(?<![\w/.-])((?:configs/)?[\w-]+\.yaml)", snippet.text):
            # `configs/pystd.yaml`, or `debug.yaml` among the configs (--config's: checked above)
            if not (commands and "--config" in tokens):
                path = path if path.startswith("configs/") else f"configs/{path}"
                check_config_file(path, every_config, where, report)
    if not commands_only:  # --set in prose too; a key without a dot is caught here
        for m in SET_KEY.finditer(re.sub(r"\s+", " ", text)):
            check_key(m.group(1), None, every_config, f"{name} (--set {m.group(1)})", report)
    return report


def check_alone(tokens: list[str], commands: list[str], where: str, report: Report) -> None:
    """Flags in a span without a command: of one of `commands`, those its paragraph or list item
    names, or of some dflash command where it names none. `--set KEY=VALUE` alone is checked by
    its key: the key's config says which commands take it."""
    if tokens[0] in OTHER_PROGRAMS_FLAGS or tokens[0] == "--set":
        return
    candidates = [c for c in commands if c in main.commands] or list(main.commands)
    for flag, value in flags_shown(tokens, report):
        takers = [c for c in candidates if flag in OPTIONS[c]]
        if not takers:
            report.add(where, f"`{flag}` is no option of `dflash {'|'.join(candidates)}`")
            continue
        choices = [OPTIONS[c][flag].type for c in takers]
        fits = any(
            set(value.split("|")) <= set(getattr(choice, "choices", ())) for choice in choices
        )
        if isinstance(choices[0], click.Choice) and not PLACEHOLDER.match(value) and not fits:
            report.add(
                where,
                f"`{flag} {value}`: `dflash {'|'.join(takers)}` takes "
                f"{sorted({v for choice in choices for v in choice.choices})}",
            )


DOCS = {"README.md": False, "FORMAT.md": False, "BENCHMARKS.md": True}


@pytest.mark.parametrize("doc", list(DOCS))
def test_docs_name_only_what_exists(doc: str) -> None:
    report = check_doc((ROOT / doc).read_text(), doc, commands_only=DOCS[doc])
    assert not report.problems, "\n".join(report.problems)


def test_readme_is_read_whole() -> None:
    """The extraction sees what README shows: every command, the fenced examples' flags and the
    keys in spans, fences and their comments (a parser that found nothing would pass)."""
    report = check_doc((ROOT / "README.md").read_text(), "README.md")
    assert report.commands == set(main.commands)
    assert {"--json-out", "--no-stop-at-eos", "--endpoint", "--step", "--version"} <= report.flags
    keys = {"text.stop_at_eos", "run.keep_checkpoints", "data.hidden_as_fp8", "sampling.*"}
    assert keys | {"run.export_best", "text.new_tokens", "data.dev_store"} <= report.keys


# (what README shows, a misspelling or misuse of it, what the report must name)
MISTAKES = [
    ("`text.stop_at_eos=false`", "`text.stop_at_eoss=false`", "`text.stop_at_eoss`"),
    ("# run.keep_checkpoints newest", "# run.keep_checkpoint newest", "`run.keep_checkpoint`"),
    ("--set data.hidden_as_fp8=true`", "--set data.hidden_as_fp16=true`", "hidden_as_fp16"),
    ("--set text.new_tokens=128", "--set text.new_token=128", "`text.new_token`"),
    ("`optim.lr`", "`optm.lr`", "'optm' is no config section"),
    ("`sampling.*`", "`sampler.*`", "'sampler' is no config section"),
    ("--set packing.seq_len=4096", "--set seq_len=4096", "`seq_len`"),
    ("--set optim.schedule=wsd`", "--set optim.schedule=wsdd`", "'wsdd'"),
    ("report_to=[tensorboard, wandb]", "report_to=[tensorboard, mlflow]", "mlflow"),
    (
        "--json-out runs/q8b/acceptance.json",
        "--json-output runs/q8b/acceptance.json",
        "--json-output",
    ),
    ("dflash evaluate-offline --drafter", "dflash evaluate-offlin --drafter", "evaluate-offlin`"),
    ("`dflash --version`", "`dflash --versions`", "`--versions`"),
    ("`dflash evaluate --no-stop-at-eos`", "`dflash evaluate --no-stop-eos`", "`--no-stop-eos`"),
    ("`--no-stop-at-eos` decodes", "`--no-stop-eos` decodes", "`--no-stop-eos`"),
    ("`--sample N`", "`--samples N`", "`--samples`"),
    ("`--dtype float32|float16`", "`--dtype float32|float64`", "float64"),
    ("`dflash train --follow`", "`dflash extract --follow`", "no option of `dflash extract`"),
    ("`dflash extract --set target.device_map", "`dflash generate --set target.device_map", "gen"),
    ("`configs/pystd.yaml`", "`configs/pystd2.yaml`", "configs/pystd2.yaml does not exist"),
    ("`debug.yaml`", "`tiny.yaml`", "configs/tiny.yaml does not exist"),
]


@pytest.mark.parametrize("shown, mistake, named", MISTAKES, ids=[m[1] for m in MISTAKES])
def test_a_mistake_in_a_copy_of_readme_is_named(
    tmp_path: Path, shown: str, mistake: str, named: str
) -> None:
    text = (ROOT / "README.md").read_text()
    assert shown in text, f"README no longer shows {shown!r}: pick another example"
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(shown, mistake, 1))
    problems = check_doc(copy.read_text(), "README.md").problems
    assert any(named in problem for problem in problems), problems


def test_the_allow_lists_hide_nothing() -> None:
    """No allow-listed name could be a config key or a dflash option, and no config key looks
    like a file name: the exceptions never skip a real name."""
    assert not {name.split(".")[0] for name in NOT_CONFIG_KEYS} & SECTIONS
    assert not {flag for options in OPTIONS.values() for flag in options} & set(
        OTHER_PROGRAMS_FLAGS
    )
    leaves = {key.rsplit(".", 1)[-1] for keys in KEYS.values() for key in keys}
    assert not leaves & FILE_SUFFIXES
