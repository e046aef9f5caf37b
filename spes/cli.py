"""Command-line help shared by spes's entry points."""

from __future__ import annotations

import argparse
import os
import sys


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
