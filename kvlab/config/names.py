"""Names that become paths: ``run.experiment``, ``run.method`` and the names a sweep generates.

A run writes ``<run.dir>/<run.experiment>/<run.method>/``. The two names are each **one path
component**, never a path: a name holding ``/`` or ``..``, an absolute path, an empty name or
``.`` would put the run's files into another run's directory (and ``--run.overwrite true`` would
delete that run's results), so :func:`check_name` refuses them, naming the field. A name must
also fit the file system (at most :data:`MAX_NAME_BYTES` bytes in UTF-8) and hold no control
characters. :func:`run_directory` then checks that the resolved directory lies inside the
resolved ``run.dir`` (a symbolic link inside ``run.dir`` cannot lead elsewhere either).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.config.errors import ConfigError

#: the longest file name most file systems accept (ext4, XFS, APFS: 255 bytes)
MAX_NAME_BYTES = 255
SEPARATORS = ("/", "\\")


def check_name(field: str, value: object) -> str:
    """``value`` as a run name for ``field`` (``run.experiment``, ``run.method``); refuses anything
    that is not one plain path component (see the module docstring)."""
    if not isinstance(value, str):
        raise ConfigError(f"{field} must be a name (a string), got {value!r}. Write a name such as `snapkv`.")
    problem = None
    if not value.strip():
        problem = "is empty"
    elif value in (".", ".."):
        problem = f"is {value!r}, which names a directory above or at the experiment"
    elif any(sep in value for sep in SEPARATORS):
        problem = "holds a path separator, so it would name a directory elsewhere"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        problem = "holds a control character"
    elif value != value.strip():
        problem = "starts or ends with white space"
    elif len(value.encode("utf-8")) > MAX_NAME_BYTES:
        problem = (
            f"is {len(value.encode('utf-8'))} bytes long, more than a file name may be ({MAX_NAME_BYTES})"
        )
    if problem is not None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise ConfigError(
            f"{field} = {shown!r} {problem}. {field} is one directory name inside run.dir (a run writes "
            "<run.dir>/<run.experiment>/<run.method>/): write a plain name such as `snapkv_test`, and set "
            "the parent folder with --run.dir."
        )
    return value


def run_directory(root: str | Path, experiment: str, method: str) -> Path:
    """``root/experiment/method`` after :func:`check_name` of both names, refused unless its resolved
    path lies inside the resolved ``root`` (symbolic links followed)."""
    check_name("run.experiment", experiment)
    check_name("run.method", method)
    if not isinstance(root, str | Path) or not str(root).strip():
        raise ConfigError(f"run.dir must be a directory path, got {root!r}. Write e.g. `--run.dir runs`.")
    base = Path(root).expanduser()
    run_dir = base / experiment / method
    resolved_base, resolved = base.resolve(), run_dir.resolve()
    if resolved_base not in resolved.parents:
        raise ConfigError(
            f"the run directory {run_dir} resolves to {resolved}, outside run.dir ({resolved_base}): a "
            "symbolic link inside run.dir leads elsewhere. Remove the link or choose another "
            "--run.experiment / --run.method."
        )
    return run_dir
