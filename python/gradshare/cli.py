"""The `gradshare` command (also `python -m gradshare`): train, plan, info."""
from __future__ import annotations

import importlib
import json
import os
import sys

# subcommand -> module with add_arguments(parser) and run(args) -> exit code
_SUBCOMMANDS = {
    "train": ("gradshare.train", "train a model with gradient sharing or parameter averaging"),
    "plan": ("gradshare.plan", "advise which scheme to use for a model, workers and link"),
}


_DESCRIPTION = """Communication-efficient data-parallel training.

Examples:
    gradshare train --workers 2
    gradshare plan --params 25M --workers 8 --bandwidth 1gbit --step-time 100
    gradshare COMMAND --help
"""
_INFO = "print what the native library was built with"


def _info(args) -> int:
    from gradshare import build_info

    print(json.dumps(build_info(), indent=2))     # "version": the native library's, set from __version__
    return 0


def main(argv=None) -> int:
    from gradshare.argtypes import HelpFormatter, OneLineParser

    from gradshare import __version__

    parser = OneLineParser(prog="gradshare", formatter_class=HelpFormatter, description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"gradshare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, title="commands",
                                metavar="COMMAND")
    sub.add_parser("info", help=_INFO, description=_INFO + " (JSON): version, CUDA and its architectures, "
                   "OpenMP, CPU threads, message format version.",
                   formatter_class=HelpFormatter).set_defaults(func=_info)
    for name, (module, help_text) in _SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        # The module's docstring is its help: plain text, printed by HelpFormatter in readable lines.
        p = sub.add_parser(name, help=help_text, description=mod.__doc__, formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # a refused option (status 2, one line already printed) or --help (0)
        return int(exc.code or 0)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()                         # a closed pipe shows here, not in Python's flush at exit
        return status
    except BrokenPipeError:
        # The reader went away (``gradshare info | head``): nothing more to print, and no traceback. Python
        # would report the same error again when it flushes stdout at exit, so stdout goes to devnull first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                                 # 128 + SIGPIPE, as a shell reports a process killed by it


if __name__ == "__main__":
    sys.exit(main())
