"""What titanloop's commands share about their outputs and their errors (standard library only, so a command answers
a bad command line before torch loads).

    check_output(path, "--out", overwrite=args.overwrite, kind="dir")   # before any model or data is loaded
    one_line_errors(fn, args, debug=debug_enabled(args.debug))           # `error: ...`, no traceback

Outputs: a command refuses to write over an existing non-empty directory or an existing file unless `--overwrite`
is given, and never writes onto one of its own inputs (paths compared after resolving `..`, `~` and links).
Errors: a bad input is one line on stderr and a nonzero exit; `--debug` or TITANLOOP_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from titanloop.config_errors import ConfigError

DEBUG_ENV = "TITANLOOP_DEBUG"
DEBUG_HINT = f"rerun with --debug (or {DEBUG_ENV}=1) for the traceback"


def debug_enabled(flag: bool = False) -> bool:
    """--debug given, or TITANLOOP_DEBUG set to anything but empty / 0."""
    return bool(flag) or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def resolved(path) -> Path:
    return Path(os.path.expanduser(os.fspath(path))).resolve()


def check_output(path, flag: str, *, overwrite: bool, kind: str, inputs=()) -> Path:
    """The resolved output path, or a one-line ConfigError when writing there would replace something unasked.

    kind "dir": a file at `path` is refused; a non-empty directory is refused unless `overwrite`.
    kind "file": a directory at `path` is refused; an existing file is refused unless `overwrite`.
    inputs: (flag, path) pairs of what the command reads; the output may never be one of them."""
    out = resolved(path)
    for name, value in inputs:
        if value is not None and resolved(value) == out:
            raise ConfigError(f"{flag}={os.fspath(path)!r} is {name} itself: choose another {flag} path")
    if kind == "dir":
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{flag}={os.fspath(path)!r} is a file: expected a directory (new or empty)")
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise ConfigError(
                f"{flag}={os.fspath(path)!r} is not empty: choose a new directory, or pass --overwrite to replace "
                "what this command writes there"
            )
    else:
        if out.is_dir():
            raise ConfigError(f"{flag}={os.fspath(path)!r} is a directory: expected a file path")
        if out.exists() and not overwrite:
            raise ConfigError(
                f"{flag}={os.fspath(path)!r} exists: choose a new path, or pass --overwrite to replace it"
            )
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def error_line(e: BaseException) -> str:
    """`error: <message>` for bad input the code names (a ConfigError, titanloop.data's ShardError), else
    `error: <Type>: <first line> (<how to see the traceback>)`."""
    named = isinstance(e, ConfigError) or any(c.__name__ == "ShardError" for c in type(e).__mro__)
    return f"error: {first_line(e)}" if named else f"error: {type(e).__name__}: {first_line(e)} ({DEBUG_HINT})"


def one_line_errors(fn, *args, debug: bool = False):
    """fn(*args); an exception becomes SystemExit(`error_line`): that one line on stderr, exit status 1. With
    `debug` everything propagates with its traceback."""
    if debug:
        return fn(*args)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - bad input the code does not name yet is still one line
        raise SystemExit(error_line(e)) from None
