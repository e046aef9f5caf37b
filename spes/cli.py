"""Command-line help shared by spes's entry points."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, where it has one: a required flag, or a None default, shows none (argparse
    would print "(default: None)" after a value the user must give, or after a help that says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)
