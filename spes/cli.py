"""What spes's entry points share: the parser (a mistyped flag answered with the flag it likely meant), the help
format and the printing of long help."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of an unknown flag names the flag it likely meant, as an unknown config key is
    answered (`spes.schema`): `--tokenfile x` got only "unrecognized arguments". A refusal for a missing required
    argument names the unknown flags too: argparse checks those first, so `--chekpoint x` was answered only with
    "--checkpoint is required", a flag the user believed given. `takes_overrides`: its caller reads each unknown
    `--key=value` word as an override of the run's config, so such a word is named in no refusal of the parser.
    `words`: those of the latest parse, for its refusal (a subcommand's parser gets the words after its name)."""

    def __init__(self, *args: Any, takes_overrides: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.takes_overrides = takes_overrides
        self.words: list[str] = []

    def parse_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}{meant_flags(rest, parser_flags(self))}")
        return parsed

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self.words, namespace)

    def error(self, message: str) -> NoReturn:
        # NOTE: argparse refuses a missing required argument through `error` with its own text, and has no other sign
        if message.startswith("the following arguments are required: ") or re.fullmatch(
            "one of the arguments .* is required", message
        ):
            message += unknown_flags_hint(self.unknown_flags(), parser_flags(self))
        super().error(message)

    def refuse_unknown_flags(self, allowed: Iterable[str] = ()) -> None:
        """For a parser that takes overrides, after its `parse_known_args`: refuse, as `parse_args` does, the unknown
        flags its caller would take for overrides but those in `allowed`, naming the flag each likely meant. No
        override is written without `=value`, so `--partiton` was refused only as a malformed override."""
        if unknown := [flag for flag in self.unknown_flags() if flag not in allowed]:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{meant_flags(unknown, parser_flags(self))}")

    def unknown_flags(self) -> list[str]:
        """The flags in the latest parse's words that are none of this parser's (each once, without its `=value`):
        not a word after `--` (a positional value), nor one with a space that names no flag (argparse takes it for
        a value), nor an abbreviation of a flag where argparse takes those, nor an override where the parser takes
        them. A word that looks like a flag is never a flag's value: argparse then refuses that flag first."""
        words = self.words[: self.words.index("--")] if "--" in self.words else self.words
        flags = [f for f in parser_flags(self) if f.startswith("--")]
        unknown = []
        for word in words:
            flag, is_set, _ = word.partition("=")
            if (
                not word.startswith("--")
                or " " in word
                or (is_set and self.takes_overrides)
                or any(f == flag or (self.allow_abbrev and f.startswith(flag)) for f in flags)
            ):
                continue
            unknown.append(flag)
        return list(dict.fromkeys(unknown))


def unknown_flags_hint(unknown: Sequence[str], flags: Iterable[str]) -> str:
    """ " (--x is not a flag of this command; did you mean --y?)" after a refusal that came before argparse handed
    back the unknown flags, else "" when there are none."""
    if not unknown:
        return ""
    are = "is not a flag" if len(unknown) == 1 else "are not flags"
    return f" ({' and '.join(unknown)} {are} of this command{meant_flags(unknown, flags)})"


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
