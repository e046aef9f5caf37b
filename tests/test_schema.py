"""spes.schema on sections of its own (not the run's): typed fields from plain data and YAML, every refusal one line
naming the key, the value and what to do; numbers against their ranges, on a section and on a command's flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from spes.schema import (
    ConfigError,
    Range,
    Section,
    config_help,
    from_dict,
    from_file_and_overrides,
    number_flag,
    read_mapping,
    to_dict,
)


@dataclass(kw_only=True)
class Inner(Section):
    KEY: ClassVar[str] = "inner."
    RENAMED: ClassVar[dict[str, str]] = {"old_rate": "rate"}

    rate: float = field(default=0.5, metadata={"doc": "a rate", "range": Range(gt=0, le=1)})


@dataclass(kw_only=True)
class Outer(Section):
    name: str = field(default="run", metadata={"doc": "a name"})
    kind: Literal["a", "b"] = field(default="a", metadata={"doc": "a choice"})
    steps: list[int] = field(default_factory=list, metadata={"doc": "steps"})
    inner: Inner = field(default_factory=Inner, metadata={"doc": "a section"})
    extra: Inner | None = field(default=None, metadata={"doc": "an optional section"})


def test_plain_data_becomes_the_typed_sections_converting_only_what_is_lossless() -> None:
    built = from_dict(Outer, {"name": "x", "kind": "b", "steps": [1, 2.0], "inner": {"rate": "1e-1"}, "extra": {}})
    assert built == Outer(name="x", kind="b", steps=[1, 2], inner=Inner(rate=0.1), extra=Inner())
    assert to_dict(built)["inner"] == {"rate": 0.1}


@pytest.mark.parametrize(
    ("data", "refusal"),
    [
        ({"nmae": "x"}, "config: unknown config key 'nmae'; did you mean 'name'?"),
        (
            {"inner": {"old_rate": 0.1}},
            "config: unknown config key 'inner.old_rate'; it is now 'inner.rate' (same values)",
        ),
        ({"inner": {"rate": 2}}, "config: config key 'inner.rate' = 2.0 must be in (0, 1]"),
        ({"kind": "c"}, "config: config key 'kind' = 'c' must be one of ['a', 'b']"),
        (
            {"steps": "1, 2"},
            "config: config key 'steps' = '1, 2' has the wrong type: expected list[int]; write a list: steps: [1, 2]",
        ),
        ({"extra": 3}, "config: config key 'extra' = 3 has the wrong type: expected Inner | None"),
        ({"inner": [1]}, "config: config key 'inner' = [1] has the wrong type: expected Inner"),
    ],
)
def test_a_refusal_names_the_key_the_value_and_what_to_do(data: dict, refusal: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(Outer, data)
    assert str(err.value) == refusal


def test_yaml_with_overrides_resolves_against_the_sections_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: ${kind}-${inner.rate}\ninner:\n  rate: 0.25\n")
    assert read_mapping(Outer, path, ["--kind=b"], str(path)) == {
        "name": "b-0.25",
        "inner": {"rate": 0.25},
        "kind": "b",
    }
    with pytest.raises(ConfigError, match=r"command line \(--inner.rat=1\): unknown config key 'inner.rat'; did you"):
        read_mapping(Outer, path, ["--inner.rat=1"], str(path))


def test_a_file_value_of_the_wrong_kind_is_named_though_an_interpolation_names_a_default(tmp_path: Path) -> None:
    """A list where a section goes keeps the file from merging with the defaults, so its `${kind}` (a key it leaves
    at its default) cannot be resolved: the refusal still names the value of the wrong kind, with or without an
    override below it, not the interpolation."""
    path = tmp_path / "run.yaml"
    path.write_text("name: ${kind}\ninner: [1]\n")
    wrong = r"config key 'inner' = \[1\] has the wrong type: expected Inner$"
    with pytest.raises(ConfigError, match=wrong):
        read_mapping(Outer, path, ["--inner.rate=0.2"], str(path))
    with pytest.raises(ConfigError, match=wrong):
        from_dict(Outer, read_mapping(Outer, path, [], str(path)))


@dataclass
class Plain:
    """A dataclass that is no `Section`: no ranges, no renamed keys."""

    size: int = 1


def test_any_dataclass_is_built_and_its_unknown_keys_named() -> None:
    assert from_dict(Plain, {"size": 2}) == Plain(2)
    with pytest.raises(ConfigError, match=r"^config: unknown config key 'sise'; did you mean 'size'\?$"):
        from_dict(Plain, {"sise": 2})


def test_help_names_each_key_with_its_type_range_and_doc_and_each_section_a_heading() -> None:
    assert config_help(Outer) == [
        "  --name='run'  [str]  a name",
        "  --kind='a'  ['a' | 'b']  a choice",
        "  --steps=[]  [list[int]]  steps",
        "  inner.*  -- a section",
        "  --inner.rate=0.5  [float in (0, 1]]  a rate",
        "  extra.*  -- an optional section",
        "  --extra.rate=0.5  [float in (0, 1]]  a rate",
    ]


@dataclass(kw_only=True)
class Weights(Section):
    weights: dict[str, float] = field(default_factory=dict, metadata={"doc": "per-source weights"})

    def __post_init__(self) -> None:
        if sum(self.weights.values()) > 1:
            raise ConfigError("the weights sum past 1")  # a check that names no key


def test_a_type_of_two_arguments_reads_as_written() -> None:
    assert config_help(Weights) == ["  --weights={}  [dict[str, float]]  per-source weights"]


def test_a_refusal_naming_no_key_is_passed_on_as_it_is_beside_overrides() -> None:
    with pytest.raises(ConfigError) as err:
        from_file_and_overrides(Weights, {"weights": {"a": 0.75, "b": 0.5}}, "run.yaml", ["--weights.b=0.5"])
    assert str(err.value) == "run.yaml: the weights sum past 1" and err.value.key is None


def test_a_range_is_worded_as_a_user_reads_it() -> None:
    ranges = (Range(ge=1), Range(gt=0), Range(ge=0, lt=1), Range(gt=0, lt=1.5), Range(gt=0, le=1), Range(ge=0, le=9))
    assert [str(r) for r in ranges] == [">= 1", "> 0", "in [0, 1)", "in (0, 1.5)", "in (0, 1]", "in [0, 9]"]
    assert Range(gt=0, lt=1).holds(0.5) and not Range(gt=0, lt=1).holds(0) and not Range(ge=0, lt=1).holds(1)
    assert Range(gt=0, le=1).holds(1) and not Range(gt=0, le=1).holds(1.01) and Range(ge=0, le=9).holds(0)


@pytest.mark.parametrize(
    ("kind", "bounds", "text", "refusal"),
    [
        (float, {"gt": 0}, "nan", "nan must be a finite number > 0"),
        (float, {"gt": 0}, "-inf", "-inf must be a finite number > 0"),
        (float, {"gt": 0}, "0", "0 must be a finite number > 0"),
        (float, {"gt": 0}, "x", "'x' is not a number"),
        (int, {"ge": 0, "le": 65535}, "65536", "65536 must be an integer in [0, 65535]"),
        (int, {"ge": 1}, "1.5", "'1.5' is not an integer"),
    ],
)
def test_a_number_flag_refuses_what_its_range_does_not_hold(
    kind: type, bounds: dict[str, float], text: str, refusal: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        number_flag(kind, **bounds)(text)
    assert str(err.value) == refusal


def test_a_number_flag_parses_the_edges_of_its_range_as_its_kind() -> None:
    assert number_flag(int, ge=0, le=65535)("65535") == 65535 and number_flag(int, ge=0, le=65535)("0") == 0
    assert number_flag(gt=0, le=1)("1") == 1.0 and isinstance(number_flag(gt=0)("2"), float)
