"""The ``--help`` layout every lnstrain command line uses: the description as written, and each
option's default stated once.

argparse's ``ArgumentDefaultsHelpFormatter`` appends "(default: X)" even where the help already says
what the default is (giving "(default: its norm scheme) (default: None)"), and shows nothing for an
option without help. This one appends it to every option that has a default value and whose help
does not mention one; flags (``store_true``) and options without a default (or an empty list) are
left as written.
"""

from __future__ import annotations

import argparse
import copy


def _shows_default(action: argparse.Action) -> bool:
    return (bool(action.option_strings) and not action.required and action.nargs != 0
            and action.default not in (None, [], ()) and action.default is not argparse.SUPPRESS
            and action.help is not argparse.SUPPRESS and "default" not in (action.help or "").lower())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):  # argparse prints nothing for an option without help
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _shows_default(action) or not text:
            return text
        return f"{text} (default: %(default)s)"
