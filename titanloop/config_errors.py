"""One exception type for every bad-input error titanloop raises.

Every message is a single line that names the offending field, says what was given and what is allowed,
so a user can fix a config without reading a traceback.
"""

from __future__ import annotations

import functools
import sys


class ConfigError(ValueError):
    """A configuration or input that cannot work; the message is one line naming the field."""


def cli_errors(main):
    """Decorator for a command's `main`: a ConfigError anywhere in it is printed as one line (`error: ...` on
    stderr) and the command exits with status 2; anything else propagates."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped


def require(ok: bool, field: str, got, allowed: str) -> None:
    """Raise ConfigError(`<field>=<got> is invalid: expected <allowed>`) when `ok` is false."""
    if not ok:
        raise ConfigError(f"{field}={got!r} is invalid: expected {allowed}")


def require_choice(value, field: str, choices) -> None:
    require(value in choices, field, value, "one of " + ", ".join(repr(c) for c in choices))


def from_dict_strict(cls, d: dict, what: str):
    """cls(**d) for a dataclass, refusing unknown keys with one line that lists the allowed ones."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{what} has unknown key(s) {unknown}: allowed keys are {sorted(known)}")
    return cls(**d)
