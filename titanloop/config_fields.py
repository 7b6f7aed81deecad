"""How one TOML table (or command-line overrides) becomes a config section: one builder for every section.

Every section of the training config is a dataclass beside the code that reads it (titanloop.train.config lists
them). `build_section(name, cls, values)` checks the table's keys against the dataclass fields, converts each
value to its field's type (one-line ConfigError naming `<section>.<key>` otherwise), builds the dataclass and
runs its `validate()` when it has one that needs nothing else. A section with its own reading of the table (the
model section: a preset plus field overrides) defines `from_table(values)` instead.
`parse_section_overrides` reads `--section.key value` arguments, each value a TOML literal (`parse_literal`: `10`,
`1e-3`, `true`, `[0.9, 0.95]`, `"text"`, falling back to a plain string); `read_toml` reads a file and
`refuse_moved` refuses a key that has moved, in one line naming its new home.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
import types
import typing
from pathlib import Path

from titanloop.config_errors import ConfigError


def coerce(value, typ, name: str):
    """Check/convert a TOML or command-line value to the dataclass field type."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        typ = next(a for a in args if a is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}={value!r} is invalid: expected a number")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected a string")
    if typ in (list, dict) or typing.get_origin(typ) in (list, dict):
        want = typing.get_origin(typ) or typ
        if isinstance(value, want):
            return value
        raise ConfigError(f"{name}={value!r} is invalid: expected a {want.__name__}")
    return value


def field_types(cls) -> dict:
    """name -> type of the fields a dataclass takes in its constructor."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build_section(name: str, cls, values: dict):
    """The dataclass `cls` of section `name` from a TOML table (see the module docstring)."""
    if hasattr(cls, "from_table"):
        return cls.from_table(values)
    types_ = field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ConfigError(f"[{name}] has unknown key(s) {unknown}: allowed keys are {sorted(types_)}")
    section = cls(**{k: coerce(v, types_[k], f"{name}.{k}") for k, v in values.items()})
    validate = getattr(section, "validate", None)
    if validate is not None and not inspect.signature(validate).parameters:
        validate()
    return section


def parse_literal(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_section_overrides(args: list[str], sections: list[str]) -> dict[str, dict]:
    """["--training.steps", "10", "--data.kind=mds"] -> {"training": {"steps": 10}, "data": {"kind": "mds"}}."""
    out: dict[str, dict] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"argument {arg!r} is invalid: expected --<section>.<key> <value> with a section in {sections}"
            )
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"argument {arg!r} has no value: expected {arg} <value>")
            key, text = arg[2:], args[i + 1]
            i += 2
        section, name = key.split(".", 1)
        if section not in sections:
            raise ConfigError(f"argument --{key} names unknown section {section!r}: expected one of {sections}")
        out.setdefault(section, {})[name] = parse_literal(text)
    return out


def read_toml(path) -> dict:
    """A config file's tables; one-line ConfigError when it is missing or not TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist: pass --config train_configs/<name>.toml")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def refuse_moved(raw: dict, moved: dict[str, str]) -> None:
    """One line naming the new home of the first key of `raw` (section -> table) that `moved` lists (old -> new)."""
    for old, new in moved.items():
        section, key = old.split(".")
        if key in raw.get(section, {}):
            new_section, new_key = new.split(".")
            raise ConfigError(
                f"{old} has moved to {new}: set `{new_key} = {raw[section][key]!r}` under [{new_section}] "
                f"(or --{new} on the command line) and remove {old}"
            )
