"""Failures of the machine around a run, turned into one-paragraph messages.

- :func:`check_run_dir_writable` / :func:`make_run_dir`: the run directory can be created and
  written (no file standing where a directory must go, no read-only parent), before any model loads.
- :func:`translate_os_errors`: a disk that fills up (``ENOSPC``/``EDQUOT``), a permission or
  read-only error, or a file in the way, raised anywhere in a command, becomes a
  :class:`~kvlab.config.errors.ConfigError` (exit status 2) naming the path and the fix. Other
  ``OSError``\\ s pass through unchanged.
- :class:`RunGuard` (a Lightning callback) and :func:`guarded`: Ctrl-C stops the command cleanly
  with exit status 130 and says how to resume. Lightning turns a ``KeyboardInterrupt`` inside
  ``Trainer.predict`` into ``sys.exit(1)`` after its teardown; :class:`RunGuard` records the
  interrupt so that :func:`guarded` can tell that exit from others.

Predictions are appended one complete line per sample (a cut line is dropped on resume), so a run
stopped by any of these keeps every finished sample and the same command resumes it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from kvlab.config.errors import ConfigError

#: exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED_EXIT = 130
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass
class CommandState:
    """What :func:`guarded` needs to know of the command in progress: the run directory it writes
    (for the messages) and whether Lightning saw a ``KeyboardInterrupt``."""

    run_dir: Path | None = None
    interrupted: bool = False


#: the state of the command that :func:`guarded` runs in this context (a fresh one per command)
_COMMAND: ContextVar[CommandState | None] = ContextVar("kvlab_command", default=None)


def command_state() -> CommandState:
    """The running command's :class:`CommandState` (a throwaway one outside :func:`guarded`)."""
    return _COMMAND.get() or CommandState()


def writable(directory: Path) -> bool:
    """Whether this process may create entries in ``directory`` (``os.access``: a root user may
    write anywhere, so tests stand in a replacement to see the refusal)."""
    return os.access(directory, os.W_OK | os.X_OK)


def _file_in_the_way(path: Path) -> Path | None:
    """The first component of ``path`` (itself or an ancestor) that exists but is not a directory."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def check_run_dir_writable(run_dir: str | Path) -> None:
    """Raise :class:`ConfigError` unless ``run_dir`` exists as a writable directory or can be created."""
    run_dir = Path(run_dir)
    blocker = _file_in_the_way(run_dir)
    if blocker is not None:
        raise ConfigError(
            f"run directory {run_dir}: {blocker} is a file, but the run needs a directory there. Move or "
            "remove that file, or choose another place with --run.dir / --run.experiment / --run.method."
        )
    existing = next(p for p in (run_dir, *run_dir.parents) if p.is_dir())
    if not writable(existing):
        raise ConfigError(
            f"run directory {run_dir}: {existing} is not writable by this user, so the run cannot write "
            "its config, predictions and metrics. Choose a writable --run.dir, or fix the permissions "
            f"(e.g. `chmod u+w {existing}`)."
        )


def make_run_dir(run_dir: str | Path) -> Path:
    """Check (:func:`check_run_dir_writable`) and create ``run_dir``; returns it as a Path."""
    run_dir = Path(run_dir)
    check_run_dir_writable(run_dir)
    command_state().run_dir = run_dir
    with translate_os_errors(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def os_error_message(exc: OSError, run_dir: Path | None = None) -> str | None:
    """The one-paragraph message of a disk-full, permission or file-in-the-way ``OSError`` (else None)."""
    known = command_state().run_dir
    path = exc.filename or run_dir or known
    where = f" {path}" if path else ""
    resume = (
        " Finished samples are kept: run the same command again to resume."
        if (run_dir or known) is not None
        else ""
    )
    if exc.errno in _DISK_FULL:
        return (
            f"the disk is full: writing{where} failed ({os.strerror(exc.errno)}). Free space on that disk "
            f"(or point --run.dir at another one).{resume}"
        )
    if exc.errno in _NOT_WRITABLE:
        return (
            f"cannot write{where}: {os.strerror(exc.errno)}. Choose a writable --run.dir, or fix the "
            f"permissions of that path.{resume}"
        )
    blocker = _file_in_the_way(Path(path)) if path else None
    if isinstance(exc, NotADirectoryError | FileExistsError) and blocker is not None:
        return (
            f"cannot create the directory{where}: {blocker or 'a part of that path'} is a file. Move or "
            "remove that file, or choose another place with --run.dir / --run.experiment / --run.method."
        )
    return None


@contextlib.contextmanager
def translate_os_errors(run_dir: str | Path | None = None) -> Iterator[None]:
    """Raise disk-full, permission and file-in-the-way ``OSError``\\ s as :class:`ConfigError`."""
    try:
        yield
    except OSError as exc:
        message = os_error_message(exc, Path(run_dir) if run_dir is not None else None)
        if message is None:
            raise
        raise ConfigError(message) from exc


class RunGuard(Callback):
    """Records the run directory and a Ctrl-C seen by the trainer (for :func:`guarded`'s message)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        command_state().run_dir = self.run_dir

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Lightning calls this before turning a KeyboardInterrupt into ``sys.exit(1)``."""
        if isinstance(exception, KeyboardInterrupt):
            command_state().interrupted = True


def interrupt_message(run_dir: Path | None) -> str:
    """What was kept and how to resume, after Ctrl-C."""
    if run_dir is None:
        return "interrupted (Ctrl-C) before any run started; nothing was written."
    predictions = run_dir / "predictions.jsonl"
    done = ""
    if predictions.is_file():
        lines = sum(1 for line in predictions.read_bytes().splitlines() if line.strip())
        done = f" {lines} finished samples are saved in {predictions};"
    return (
        f"interrupted (Ctrl-C).{done} run the same command again to resume: finished samples are "
        f"skipped and the run continues in {run_dir}."
    )


def guarded(command: Callable[[list[str]], None], args: list[str]) -> None:
    """Run a ``kvlab`` command: OS errors of :func:`translate_os_errors` become :class:`ConfigError`
    (exit status 2 in ``main``); Ctrl-C prints :func:`interrupt_message` and exits with status 130."""
    state = CommandState()
    token = _COMMAND.set(state)
    try:
        with translate_os_errors():
            command(args)
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit as exc:
        if exc.code == 1 and state.interrupted:  # Lightning's exit after a KeyboardInterrupt
            _interrupted()
        raise
    finally:
        _COMMAND.reset(token)


def _interrupted() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning leaves SIGINT ignored
    print(f"kvlab: {interrupt_message(command_state().run_dir)}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)
