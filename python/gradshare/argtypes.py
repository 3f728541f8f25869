"""Argument types of the `gradshare` command: every bad value is refused while parsing, with a reason.

``number(low, high)`` parses a finite float in a range, ``integer(low)`` an int, ``count()`` a count written the way
people write parameter counts (``25000000``, ``25_000_000``, ``2.5e7``, ``25M``, ``3.7k``, ``1.2G``),
``bandwidth()`` a link rate (gradshare.costmodel.parse_bandwidth), ``data_spec()`` ``digits`` or
``mnist:PATH`` with PATH checked to hold the MNIST files, before any worker starts. ``HelpFormatter`` prints
the help in plain lines and ``FormerName`` keeps a renamed option working, hidden from the help.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from typing import Any, Callable, List, Optional, Sequence

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def number(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (an open end with low_open / high_open)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low is not None and (v < low or (low_open and v == low)):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}, got {text}")
        if high is not None and (v > high or (high_open and v == high)):
            raise argparse.ArgumentTypeError(f"must be {'<' if high_open else '<='} {high:g}, got {text}")
        return v
    return parse


def integer(low: Optional[int] = None) -> Callable[[str], int]:
    """An int >= low."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if low is not None and v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return v
    return parse


def count(low: int = 1) -> Callable[[str], int]:
    """A whole count >= low: digits with optional _ or , separators, scientific notation (2.5e7) or a k / M / G / T
    suffix (25M, 3.7k)."""
    def parse(text: str) -> int:
        t = text.strip().replace("_", "").replace(",", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)", t)
        if not m:
            raise argparse.ArgumentTypeError(f"expected a count such as 25000000, 2.5e7 or 25M, got {text!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if not math.isfinite(value) or value != int(value):
            raise argparse.ArgumentTypeError(f"expected a whole count, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return int(value)
    return parse


def bandwidth(text: str) -> float:
    """A link rate in bit/s (100mbit, 1gbit, 12.5MB/s, ...)."""
    from gradshare.costmodel import parse_bandwidth

    try:
        v = parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive rate, got {text!r}")
    return v


def data_spec(text: str) -> str:
    """``digits`` or ``mnist:PATH`` where PATH is a folder holding the four MNIST idx files (.gz or not)."""
    from gradshare.data import MNIST_FILES, find_idx

    if text == "digits":
        return text
    if not (text.startswith("mnist:") and len(text) > 6):
        raise argparse.ArgumentTypeError(f"expected digits or mnist:PATH, got {text!r}")
    path = text[len("mnist:"):]
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path}: not a folder (expected one holding the MNIST idx files)")
    for stem in MNIST_FILES:
        try:
            find_idx(path, stem)
        except FileNotFoundError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`gradshare train: error: ...`) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help in plain lines, wrapped to the terminal.

    A description's paragraphs are re-wrapped, each ``- `` item starts a line of its own and lines indented by
    four spaces (examples) print as written. An option's help keeps its own line breaks and gets
    "(default: X)" once: only where the option has a default worth saying (not None, False or empty) and its
    help does not already say its default in words.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks: List[List[str]] = []                       # [kind, text]: para, item, verbatim or blank
        for line in textwrap.dedent(text).strip("\n").splitlines():
            words = line.strip()
            if not words:
                blocks.append(["blank", ""])
            elif line.startswith("    "):
                blocks.append(["verbatim", line])
            elif words.startswith("- "):
                blocks.append(["item", words])
            elif blocks and blocks[-1][0] in ("para", "item"):
                blocks[-1][1] += " " + words
            else:
                blocks.append(["para", words])
        lines: List[str] = []
        for kind, body in blocks:
            if kind in ("blank", "verbatim"):
                lines.append(indent + body if body else "")
            else:
                lines += textwrap.wrap(body, width, initial_indent=indent, break_on_hyphens=False,
                                       subsequent_indent=indent + ("  " if kind == "item" else ""))
        return "\n".join(lines)

    def _split_lines(self, text: str, width: int) -> List[str]:
        return [part for line in text.splitlines()
                for part in (textwrap.wrap(line, width, break_on_hyphens=False) or [""])]

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default is None or default is False
                or default is argparse.SUPPRESS or (isinstance(default, (str, list)) and not default)):
            return text
        # A help of several lines (a list) gets its default on a line of its own, not on the last item's.
        return text + ("\n" if "\n" in text else " ") + "(default: %(default)s)"


class FormerName(argparse.Action):
    """A former option name, hidden from the help: stores into the new option's place and says on stderr what
    the option is called now (``add_argument("--old", action=FormerName, new="--new", dest=...)``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any):
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated: use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)
