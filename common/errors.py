"""User-facing failures: one `error:` line with the fix, the traceback only at DEBUG.

Every `dflash` command runs under `cli_errors`, which prints one line for any exception:

- a user error (ValueError, a disk full or file-size limit, a missing or unreadable file, a
  damaged safetensors file): `error: <message>`, exit 2;
- anything else (a bug): `error: <type>: <message>` plus how to get the traceback, exit 1;
- a job stopped on request after saving its progress (`Stopped`): `stopped: <message>`, exit
  with its own code;
- Ctrl-C that reaches the command (generate, extract, a second one in train; through
  torchrun's launcher too): `interrupted: ...` with how to resume, exit 130, where Click's
  own "Aborted!" exited 1, the code of a bug.

`DFLASH_LOG_LEVEL=DEBUG` prints the traceback first. Worker processes started through
torchrun's launcher fail as a `ChildFailedError` holding whichever rank died first, often a
peer that only saw its neighbour vanish ("Connection reset by peer"); so each worker entry is
decorated with `report_to_launcher`, which writes its own error to `$DFLASH_ERROR_DIR` before
the process group goes away, and `cli_errors` reports the first user error found there.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from safetensors import SafetensorError

from common.durable import NO_SPACE_ERRNOS, OutOfSpaceError
from common.logging import LEVEL_ENV, global_rank

ERROR_DIR_ENV = "DFLASH_ERROR_DIR"
DEBUG_HINT = f"run with {LEVEL_ENV}=DEBUG for the traceback"
USER_EXIT, BUG_EXIT = 2, 1
INTERRUPT_EXIT = 128 + signal.SIGINT  # as a shell reports a command Ctrl-C ended
# what stays of an interrupted command's work, by command name; others just stop
RESUME_HINTS = {
    "generate": "the chunks written so far stay; rerun the same command to resume",
    "extract": "the shards committed so far stay; rerun the same command to resume",
    "train": "rerun the same command to resume from the newest checkpoint",
}

F = TypeVar("F", bound=Callable[..., Any])

# OSErrors that describe the user's files, not our code: the message (with the path) is the fix.
_USER_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.ENOTEMPTY,
    errno.EROFS,
    errno.EIO,
} | NO_SPACE_ERRNOS


class Stopped(Exception):
    """A job that stopped early on request (a signal, a time limit) after saving its progress:
    not a failure; the command exits with `exit_code` and the message says how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class WorkerError(Exception):
    """A worker process's error, as it reported it (see `report_to_launcher`)."""

    def __init__(self, message: str, user: bool, trace: str) -> None:
        super().__init__(message)
        self.user, self.trace = user, trace


def user_message(err: BaseException) -> str | None:
    """The one-line message of a user error, or None for an error of the code itself."""
    if isinstance(err, WorkerError):
        return str(err) if err.user else None
    if isinstance(err, OutOfSpaceError | ValueError):
        return str(err)
    if isinstance(err, OSError) and err.errno in _USER_ERRNOS:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where}"
    if isinstance(err, SafetensorError):  # raised on a truncated or garbled file
        return f"a safetensors file is damaged or unreadable ({err}); rewrite it"
    return None


def report_to_launcher(fn: F) -> F:
    """Decorate a worker's entry: on an exception, write it to `$DFLASH_ERROR_DIR` (when the
    launching command set one) before re-raising, so the launcher reports this rank's error
    rather than a peer's consequence of it. Decorate the function that runs *inside* the
    process group's try/finally, so the report precedes the group's teardown."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            folder = os.environ.get(ERROR_DIR_ENV)
            if folder:
                message = user_message(err)
                report = {
                    "time": time.time(),
                    "user": message is not None,
                    "message": message or f"{type(err).__name__}: {err}",
                    "trace": traceback.format_exc(),
                }
                if isinstance(err, Stopped):
                    report.update(message=str(err), stopped=err.exit_code)
                Path(folder, f"rank-{global_rank()}.json").write_text(json.dumps(report))
            raise

    return wrapper  # type: ignore[return-value]


def first_worker_error(folder: str | Path) -> WorkerError | Stopped | None:
    """The first user error the workers reported in `folder`, else the earliest error; when
    every rank stopped on request (the launcher then fails too), that stop."""
    reports = []
    for path in Path(folder).glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank killed while writing: the others suffice
            continue
    if not reports:
        return None
    errors = [r for r in reports if "stopped" not in r]
    if not errors:
        return Stopped(reports[0]["message"], reports[0]["stopped"])
    best = min(errors, key=lambda r: (not r["user"], r["time"]))
    return WorkerError(best["message"], best["user"], best["trace"])


@contextmanager
def worker_reports() -> Iterator[None]:
    """Give launched workers an error folder; a worker failure comes out as its WorkerError."""
    if os.environ.get(ERROR_DIR_ENV):  # nested (a command calling another): the outer one reads
        yield
        return
    with tempfile.TemporaryDirectory(prefix="dflash-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder
        try:
            yield
        except Exception as err:
            reported = first_worker_error(folder)
            if reported is None:
                raise
            raise reported from err
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)


def debug_enabled() -> bool:
    return os.environ.get(LEVEL_ENV, "").upper() == "DEBUG"


def cli_errors(fn: F) -> F:
    """Decorate a Click command: any exception becomes one `error:` line and an exit code
    (2 for user errors, 1 for bugs); the traceback is printed only at DEBUG."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with worker_reports():
                return fn(*args, **kwargs)
        except KeyboardInterrupt:
            _interrupted()
        except Exception as err:
            if _launcher_interrupted(err):
                _interrupted()
            if isinstance(err, _click_exceptions()):
                raise  # usage errors and exits: Click prints and exits itself
            if isinstance(err, Stopped):  # progress saved: how to go on, not an error
                print(f"stopped: {err}", file=sys.stderr)
                logging.shutdown()
                sys.exit(err.exit_code)
            message = user_message(err)
            if debug_enabled():
                trace = err.trace if isinstance(err, WorkerError) else traceback.format_exc()
                print(trace, file=sys.stderr, end="")
            if message is not None:
                print(f"error: {message}", file=sys.stderr)
                sys.exit(USER_EXIT)
            text = str(err) if isinstance(err, WorkerError) else _one_line(err)
            hint = "" if debug_enabled() else f" ({DEBUG_HINT})"
            print(f"error: {text}{hint}", file=sys.stderr)
            logging.shutdown()
            sys.exit(BUG_EXIT)

    return wrapper  # type: ignore[return-value]


def _interrupted() -> None:
    """Exit as Ctrl-C asked, saying what stays of the work and how to go on."""
    import click

    ctx = click.get_current_context(silent=True)
    hint = RESUME_HINTS.get(ctx.info_name if ctx else "")
    print(f"interrupted (Ctrl-C){': ' + hint if hint else ''}", file=sys.stderr)
    logging.shutdown()
    sys.exit(INTERRUPT_EXIT)


def _launcher_interrupted(err: BaseException) -> bool:
    """torchrun's launcher (several --devices) turns its own Ctrl-C into a SignalException."""
    return type(err).__name__ == "SignalException" and getattr(err, "sigval", None) == (
        signal.SIGINT
    )


def _one_line(err: BaseException) -> str:
    """`Type: message` of an unexpected error; for a ChildFailedError (a worker that did not
    report, e.g. one killed by a signal) its first failure's own message, not the banner."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = min(failures.values(), key=lambda f: f.timestamp)
        message = first.message
        text = message.get("message", "") if isinstance(message, dict) else str(message)
        return f"worker rank {first.local_rank} (exit code {first.exitcode}): {text}"
    return f"{type(err).__name__}: {err}"


def _click_exceptions() -> tuple[type[BaseException], ...]:
    import click

    return (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort)
