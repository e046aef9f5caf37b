"""What spes's entry points share: the parser (a mistyped flag answered with the flag it likely meant), the help
format and the printing of long help."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of an unknown flag names the flag it likely meant, as an unknown config key is
    answered (`spes.schema`): `--tokenfile x` got only "unrecognized arguments"."""

    def parse_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}{meant_flags(rest, parser_flags(self))}")
        return parsed


def meant_flags(words: Iterable[str], flags: Iterable[str]) -> str:
    """ "; did you mean --x?" naming the known flag closest to each unknown `--flag` (or `--flag=value`) in `words`
    that has one, else ""."""
    known = sorted(f for f in flags if f.startswith("--"))
    meant = [
        close[0]
        for word in words
        if word.startswith("--") and (close := difflib.get_close_matches(word.partition("=")[0], known))
    ]
    return f"; did you mean {' or '.join(dict.fromkeys(meant))}?" if meant else ""


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands (an unknown flag of `hf export` reaches the top
    parser)."""
    flags: set[str] = set()
    for action in parser._actions:  # NOTE: argparse has no public list of a parser's flags
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, where it has one: a required flag, or a None default, shows none (argparse
    would print "(default: None)" after a value the user must give, or after a help that says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def print_text(text: str) -> None:
    """`print` for a command's long output (`--help`), ended quietly when its reader stops early (`| head`, quitting
    `less`), as argparse does: otherwise the BrokenPipeError ends the command as a bug of spes (exit 6, a traceback
    kept)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # NOTE: stdout now points at nothing, so Python's own flush at exit finds no closed pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
