"""Typed configs: dataclass sections built from plain data or YAML, every key and value checked on the way in.

A YAML file is read with OmegaConf (for `${...}` interpolation and `--section.key=value` overrides), resolved to
plain Python values against the config class's defaults, and checked against the dataclasses by `from_dict`: an
unknown key is refused with a "did you mean" hint (or the key that now holds it, a section's `RENAMED`), a wrong
type with the key, the value and the type a user reads, a number out of its field's range with the range
(`Section`). Every refusal is a `ConfigError`, one line naming the key and what to do. The run's own sections and
their cross-field checks are `spes.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A user-fixable problem with a config file or override: the message names the key and what to do; `key` is
    that key (`model.n_heads`) where one key is the culprit, so a caller that filled it from elsewhere (the HF
    import) can name its own source too; `related`, the other keys a check between keys read (`model.d_model`
    divisible by `model.n_heads`), so an override of any of them can be named as the source."""

    def __init__(self, message: str, key: str | None = None, related: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.related = related


@dataclass(frozen=True)
class Range:
    """A number's allowed values: `ge <= x` or `gt < x`, and `x < lt` or `x <= le` where an upper bound is given."""

    ge: float | None = None
    gt: float | None = None
    lt: float | None = None
    le: float | None = None

    def __str__(self) -> str:
        """`>= 1`, `> 0`, `in [0, 1)`, `in (0, 1]`: as `--help` and the refusal word it."""
        if self.lt is None and self.le is None:
            return f">= {self.ge:g}" if self.ge is not None else f"> {self.gt:g}"
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}"
        return f"in {low}, {self.lt:g})" if self.lt is not None else f"in {low}, {self.le:g}]"

    def holds(self, x: float) -> bool:
        low = (self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
        return low and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le)


def number_flag(kind: type[int] | type[float] = float, **bounds: float) -> Callable[[str], float]:
    """An argparse `type=` for a command's numeric flag, checked as a config key is (`number_flag(gt=0)`,
    `number_flag(int, ge=0, le=65535)`): a value out of `Range(**bounds)`, or NaN or infinity, is argparse's
    one-line usage error, `argument --max_mb: nan must be a finite number > 0`."""
    allowed = Range(**bounds)
    what, finite = ("an integer", "an integer") if kind is int else ("a number", "a finite number")

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (math.isfinite(value) and allowed.holds(value)):
            raise argparse.ArgumentTypeError(f"{text} must be {finite} {allowed}")
        return value

    return parse


def _number_problem(value: Any, allowed: Range | None) -> str | None:
    """What is wrong with a key's number (no float key takes NaN or infinity), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return "must be a finite number"
    return None if allowed is None or allowed.holds(value) else f"must be {allowed}"


class Section:
    """A config section: built from YAML or in code, its numbers are checked against their fields' ranges."""

    KEY: ClassVar[str] = ""  # where it sits in the run's YAML ("model."): keys are named as a user writes them
    RENAMED: ClassVar[dict[str, str]] = {}
    """Keys of earlier versions and the key that now holds the setting (same values): named when one is given."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            problem = _number_problem(value, f.metadata.get("range"))
            if problem:
                hint = typing.get_type_hints(type(self))[f.name]  # NOTE: only on a refusal (0.35 ms a section)
                nullable = " or null" if type(None) in typing.get_args(hint) else ""
                key = f"{self.KEY}{f.name}"
                raise ConfigError(f"config key '{key}' = {value!r} {problem}{nullable}", key)


def read_mapping(cls: type, path: str | Path | None, overrides: Sequence[str], where: str) -> dict[str, Any]:
    """The keys a user set for a `cls` config: the YAML file at `path` (None: no file) with the overrides
    (`--section.key=value`) over it, `${...}` resolved against `cls`'s defaults; ConfigError naming the file or the
    override at fault (`where` names the file in messages)."""
    try:
        base = OmegaConf.create({}) if path is None else _load_mapping(path)
        dotlist = checked_overrides(cls, [override_to_dotlist(o) for o in overrides])
        raw = _resolve_against_defaults(cls, _merge_overrides(cls, base, dotlist, where))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: cannot read config: {str(e).splitlines()[0]}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    return raw


def _merge_overrides(cls: type, base: Any, dotlist: list[str], where: str) -> Any:
    """The file's keys with the command line's over them. OmegaConf merges no list into a mapping, nor back, and
    reads a key below a list as an index: where that fails, a value of the wrong kind in the file is named as
    building the file alone names it, else the overrides are (a key set below a list)."""
    try:
        return OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
    except (TypeError, ValueError):
        from_dict(cls, _resolve_against_defaults(cls, base), where=where)
        given = " ".join(f"--{item}" for item in dotlist)
        raise ConfigError(
            f"command line ({given}): an override sets a key below a list of {where}; set the whole list instead"
        ) from None


def _resolve_against_defaults(cls: type, user: Any) -> Any:
    """The user's keys with `${...}` resolved, where an interpolation may name a key left at its default.

    OLMo resolves a file against its schema, so the first implementation's centralized config, which has no
    `spes_config` section, still resolves `save_folder: output/${run_name}/node${spes_config.peer_id}` (to node0).
    Only the keys the user wrote are returned (defaults stay defaults, and the inert-key warning sees only theirs).
    """
    shape = OmegaConf.to_container(user, resolve=False)
    try:
        full = OmegaConf.merge(OmegaConf.create(to_dict(cls())), user)
    except TypeError:  # OmegaConf merges no list into a mapping or back (a list for a section): from_dict names it
        try:
            return OmegaConf.to_container(user, resolve=True)
        except OmegaConfBaseException:  # an interpolation names a default: the values as written, for from_dict
            return OmegaConf.to_container(user, resolve=False)
    return _keys_of(OmegaConf.to_container(full, resolve=True), shape)


def _keys_of(resolved: Any, shape: Any) -> Any:
    """`resolved` cut to the keys of `shape` (nested mappings; anything else is taken whole)."""
    if isinstance(shape, dict) and isinstance(resolved, dict):
        return {k: _keys_of(resolved.get(k), v) for k, v in shape.items()}
    return resolved


def _load_mapping(path: str | Path) -> DictConfig:
    """The YAML file at `path`, which must hold a mapping (or nothing): ConfigError saying what it holds instead
    (OmegaConf itself fails on a list only at the merge, with a traceback, and on a single value naming no file)."""
    p = _existing(path)
    try:
        loaded = OmegaConf.load(p)
    except OSError as e:
        if type(e) is not OSError:  # a subclass: the file could not be read (permissions), said as it is
            raise
        loaded = None  # OmegaConf's refusal of a document that is one number, boolean or date
    if not isinstance(loaded, DictConfig):
        what = "a list" if isinstance(loaded, ListConfig) else "a single value"
        raise ConfigError(f"{p}: a config file must be a YAML mapping of keys to values, not {what}")
    return loaded


def _existing(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p} (pass a YAML file, e.g. configs/tiny.yaml)")
    return p


def override_to_dotlist(arg: str) -> str:
    """`--model.d_model=128` -> `model.d_model=128`."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(f"override {arg!r} must look like --section.key=value")
    return body


def _is_text(hint: Any) -> bool:
    """Whether a key of type `hint` holds text: `str` or `str | None`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set(typing.get_args(hint)) - {type(None)} == {str}
    return hint is str


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML file's syntax error as one line: where (1-based line and column) and what."""
    mark = getattr(e, "problem_mark", None)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{at}not valid YAML ({yaml_error_text(e)}); check the indentation, colons and brackets there"


def yaml_error_text(e: Exception) -> str:
    """What a YAML error (or a decoding one) says went wrong, on one line."""
    return " ".join(str(getattr(e, "problem", None) or e).split())


def checked_overrides(cls: type, dotlist: list[str]) -> list[str]:
    """`dotlist` with every override checked, so a bad one blames the command line: it names a key and has a value of
    its type (a mapping for a whole section is checked with the rest of its section, when the config is built).
    Returned with each text key's value (`str`, `str | None`) quoted: OmegaConf reads a bare value as YAML, so a run
    id `66e7320945644684` would become the float inf and `0123` a number."""
    return [_checked_override(cls, item) for item in dotlist]


def _checked_override(cls: type, item: str) -> str:
    """One override `key=value`, checked, with a text key's value taken as written. Left as they are: a value quoted
    already, null, a list or mapping (refused as the wrong type), an interpolation."""
    key, _, text = item.partition("=")
    where = f"command line (--{item})"
    hint = _lookup_field(cls, key.split("."), where=where, root=cls)
    plain = text[:1] not in ("'", '"', "[", "{") and text not in ("null", "~") and "${" not in text
    if _is_text(hint) and plain:
        escaped = text.replace("'", "''")  # YAML's single-quoted scalar
        item = f"{key}='{escaped}'"
    try:
        value: Any = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: the value is not valid YAML ({yaml_error_text(e)}); quote it") from None
    if hint is None or "${" in text:
        return item
    for part in key.split("."):
        value = value[part]
    if _dataclass_in(hint) is None or not isinstance(value, dict):
        _coerce(value, hint, key, where)
    return item


def _lookup_field(cls: type, parts: list[str], *, where: str, root: type, prefix: str = "") -> Any:
    """The type of the field a dotted key names (None below a free-form dict field); ConfigError if none, with
    the keys of `root` (the whole config) it may have meant."""
    names = [f.name for f in dataclasses.fields(cls)]
    head = parts[0]
    if head not in names:
        given = prefix + ".".join(parts)
        raise ConfigError(_unknown_key_message(cls, prefix, head, names, where, given=given, root=root))
    hint = typing.get_type_hints(cls)[head]
    if len(parts) == 1:
        return hint
    sub = _dataclass_in(hint)
    if sub is not None:
        return _lookup_field(sub, parts[1:], where=where, root=root, prefix=f"{prefix}{head}.")
    if dict in (hint, typing.get_origin(hint)):
        return None
    raise ConfigError(
        f"{where}: config key '{prefix}{head}' holds {_type_name(hint)}, not keys: there is no '{prefix}{head}."
        f"{parts[1]}'; set the whole value instead"
    )


def _unknown_key_message(
    cls: type, prefix: str, key: str, valid: list[str], where: str, *, given: str, root: type
) -> str:
    """The refusal of `key` (one part of `given`, the dotted key as written) in section `cls`: the closest key of the
    section, else the keys of `root` that `given` may have meant in another section, else every key of the section."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    meant = [f"{prefix}{close[0]}"] if close else _keys_ending_like(root, given.rpartition(".")[2])
    hint = f"; did you mean {' or '.join(map(repr, meant))}?" if meant else f"; valid keys here: {', '.join(valid)}"
    renamed = getattr(cls, "RENAMED", {})
    if key in renamed:
        hint = f"; it is now '{prefix}{renamed[key]}' (same values)"
    return f"{where}: unknown config key '{prefix}{key}'{hint}"


def _keys_ending_like(root: type, name: str) -> list[str]:
    """The dotted keys of config class `root` whose last part is `name`, else the closest one (difflib): where a key
    written in the wrong section, or in none, lives (`learning_rate` -> `optimizer.learning_rate`)."""
    keys = _dotted_keys(root)
    best = difflib.get_close_matches(name, sorted({k.rpartition(".")[2] for k in keys}), n=1)
    return [k for k in keys if k.rpartition(".")[2] in best]


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key a `cls` config holds, as a user writes it (`optimizer.learning_rate`), sections walked into."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        sub = _dataclass_in(hints[f.name])
        keys += [f"{prefix}{f.name}"] if sub is None else _dotted_keys(sub, f"{prefix}{f.name}.")
    return keys


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass inside `X` or `X | None`, if any."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def from_dict(
    cls: type, data: dict[Any, Any], *, where: str = "config", prefix: str = "", root: type | None = None
) -> Any:
    """Build dataclass `cls` from a plain dict, checking every key (YAML's may be numbers too) and type; `root`: the
    whole config `cls` is a section of (None: `cls`), whose keys an unknown one may have meant."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: config key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    whole = root or cls
    kwargs = {}
    for key, value in data.items():
        given = prefix + str(key)
        if key not in hints:
            raise ConfigError(_unknown_key_message(cls, prefix, str(key), names, where, given=given, root=whole), given)
        sub = _dataclass_in(hints[key])
        if sub is not None and isinstance(value, dict):
            kwargs[key] = from_dict(sub, value, where=where, prefix=given + ".", root=whole)
        else:
            kwargs[key] = _coerce(value, hints[key], given, where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}", e.key, e.related) from None


def from_file_and_overrides(cls: type, raw: dict[str, Any], where: str, overrides: Sequence[str]) -> Any:
    """`from_dict(cls, raw)` for a mapping read from file `where` with `overrides` over it: a refusal of a key that an
    override set names that override (`command line (--spes_config.sync_steps=0)`), not the file; a check between
    keys whose refused key no override set names the last override of another key it reads (`--model.n_heads=5`
    against the file's `model.d_model`)."""
    try:
        return from_dict(cls, raw, where=where)
    except ConfigError as e:
        given = _override_setting((e.key,) if e.key else (), overrides) or _override_setting(e.related, overrides)
        if given is None:
            raise
        message = str(e).removeprefix(f"{where}: ")
        raise ConfigError(f"command line (--{given}): {message}", e.key, e.related) from None


def _override_setting(keys: Sequence[str], overrides: Sequence[str]) -> str | None:
    """The last of `overrides` that sets one of config `keys` (itself, or a whole section holding it), as
    `key=value`."""
    for item in reversed([override_to_dotlist(o) for o in overrides]):
        name = item.partition("=")[0]
        if any(key == name or key.startswith(name + ".") for key in keys):
            return item
    return None


def _coerce(value: Any, hint: Any, key: str, where: str) -> Any:
    """Check `value` against type `hint`, converting only where it is lossless (int -> float, '1e-3' -> float); a
    section's mapping is `from_dict`'s."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                continue
        raise _type_error(key, value, hint, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: config key '{key}' = {value!r} must be one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, value, hint, where)
        (item,) = args or (Any,)
        return [_coerce(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, value, hint, where)
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, value, hint, where)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(key, value, hint, where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, value, hint, where)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, value, hint, where)
    if isinstance(value, hint):
        return value
    raise _type_error(key, value, hint, where)


def _type_name(hint: Any, allowed: Range | None = None) -> str:
    """`int`, `str | None`, `'a' | 'b' | None`, `list[float]`, `WandbConfig | None`: a type as a user reads it, in
    one style however it was written (`Optional[Literal[...]]` reads as the `X | None` beside it in `--help`);
    `allowed`, a number's range, right after the number it bounds (`int >= 1 | None`, not `int | None >= 1`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg, allowed if arg in (int, float) else None) for arg in args)
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin is not None:  # list[float]
        return f"{origin.__name__}[{', '.join(map(_type_name, args))}]"
    name = "None" if hint is type(None) else hint.__name__  # a section by its class, not by its module
    return name if allowed is None else f"{name} {allowed}"


def _type_error(key: str, value: Any, hint: Any, where: str) -> ConfigError:
    expected = _type_name(hint)
    hint_list = ""
    if isinstance(value, str) and list in (typing.get_origin(hint), *map(typing.get_origin, typing.get_args(hint))):
        written = f"--{key}=[{value}]" if where.startswith("command line") else f"{key}: [{value}]"
        hint_list = f"; write a list: {written}"
    return ConfigError(f"{where}: config key '{key}' = {value!r} has the wrong type: expected {expected}{hint_list}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (saved with every checkpoint)."""
    return dataclasses.asdict(cfg)


def config_help(cls: type, prefix: str = "") -> list[str]:
    """One line per key: dotted name, type, default and doc, for `--help`."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = _dataclass_in(hints[f.name])
        if sub is not None:  # optional sections (wandb, tensorboard) list their keys too
            lines.append(f"  {prefix}{f.name}.*  -- {f.metadata.get('doc', '')}")
            lines.extend(config_help(sub, prefix + f.name + "."))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = _type_name(hints[f.name], f.metadata.get("range"))
        lines.append(f"  --{prefix}{f.name}={default!r}  [{kind}]  {f.metadata.get('doc', '')}")
    return lines
