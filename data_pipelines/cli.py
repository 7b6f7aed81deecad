"""What every data_pipelines command shares: one-line errors, `--debug`, and checks of output paths.

A command's bad input ends in one line on stderr (`error: <what is wrong>; <how to fix it>`) and a nonzero exit,
never a Python traceback; `--debug` (or the environment variable TITANLOOP_DEBUG=1) shows the traceback instead.
Outputs are checked before any input is read: an existing output is replaced only when `--overwrite` is given,
and two outputs are compared after resolving their paths.
"""

from __future__ import annotations

import contextlib
import os
import sys

DEBUG_ENV = "TITANLOOP_DEBUG"


class InputError(Exception):
    """Bad input or arguments; the message is one line: what is wrong and how to fix it.

    An ordinary Exception (not SystemExit), so a worker process raising it survives and the pool hands it to
    the parent."""


def add_debug_flag(parser) -> None:
    parser.add_argument(
        "--debug", action="store_true", help=f"show the Python traceback of an error (or set {DEBUG_ENV}=1)"
    )


def debug_enabled(flag: bool = False) -> bool:
    return bool(flag) or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def one_line(e: BaseException) -> str:
    """The message of `e` as one line."""
    from titanloop.config_errors import ConfigError

    errors = sys.modules.get("titanloop.data.errors")  # not imported: not a ShardError (and torch stays unloaded)
    if isinstance(e, (InputError, ConfigError)) or (errors is not None and isinstance(e, errors.ShardError)):
        msg = str(e)
    elif isinstance(e, OSError) and e.filename is not None:
        msg = f"{e.filename}: {e.strerror or type(e).__name__}"
    else:
        msg = f"{type(e).__name__}: {e} (unexpected; run again with --debug for the traceback)"
    return " ".join(msg.split())


@contextlib.contextmanager
def errors_as_one_line(debug: bool = False):
    """Turn any exception raised inside into SystemExit("error: <one line>") (exit status 1), unless debugging."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        if debug_enabled(debug):
            raise
        raise SystemExit(f"error: {one_line(e)}") from None


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def resolved(path: str) -> str:
    """A path compared after resolving it (`./s/x`, `s/x/` and a symlink to it are one); URLs normalized."""
    if is_remote(path):
        return path.rstrip("/")
    return os.path.realpath(os.path.expanduser(path.removeprefix("file://")))


def _check_parent(local: str, path: str, flag: str) -> None:
    """The nearest existing ancestor of `local` is a directory (an output cannot be created under a file)."""
    parent = os.path.dirname(os.path.abspath(local))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise InputError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")


def check_new_file(path: str, flag: str, overwrite: bool) -> None:
    """An output file: not a directory, its parent not a file, and not an existing non-empty file unless
    `overwrite`."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise InputError(f"{flag} {path} is a directory: give the path of a file, e.g. {path.rstrip('/')}/out.json")
    if os.path.exists(path) and os.path.getsize(path) > 0 and not overwrite:  # an empty file holds nothing to lose
        raise InputError(f"{flag} {path} exists: choose a new path, or pass --overwrite to replace it")
    _check_parent(path, path, flag)


def check_output_dir(path: str, flag: str) -> bool:
    """A local output directory: not a file, no file on its way. Returns whether it exists and is not empty."""
    local = path.removeprefix("file://")
    if os.path.exists(local) and not os.path.isdir(local):
        raise InputError(f"{flag} {path} is a file: give a directory (new or empty)")
    _check_parent(local, path, flag)
    return os.path.isdir(local) and bool(os.listdir(local))


def write_text_atomically(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
