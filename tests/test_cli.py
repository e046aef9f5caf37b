"""spes.cli: the entry points' help shows a flag's default only where it has one."""

from __future__ import annotations

import argparse

import pytest

from spes.cli import DefaultsHelpFormatter


def test_help_shows_real_defaults_and_none_after_a_required_or_unset_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    parser = argparse.ArgumentParser(prog="p", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("config", nargs="?", help="a YAML")
    parser.add_argument("--out", required=True, help="where to write")
    parser.add_argument("--limit", help="at most this many (default: all)")
    parser.add_argument("--size", type=int, default=4096, help="how many")
    parser.add_argument("--name", default="text", help="the field (%(default)s unless given)")
    parser.add_argument("--force", action="store_true", help="replace it")
    parser.add_argument("--seed", default=argparse.SUPPRESS, help="the seed")
    lines = [" ".join(line.split()) for line in parser.format_help().splitlines()]
    for shown in (
        "config a YAML",
        "--out OUT where to write",
        "--limit LIMIT at most this many (default: all)",
        "--size SIZE how many (default: 4096)",
        "--name NAME the field (text unless given)",
        "--force replace it (default: False)",
        "--seed SEED the seed",
    ):
        assert shown in lines, shown
