"""Argument types the benchmark scripts share: a bad value is an argparse error naming the
option before anything loads or runs, not a traceback (or a table of nonsense) after it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``int`` option's type that refuses values below ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """A comma-separated list of ints >= ``minimum`` (``"1,8,32"``), at least one."""
    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not text or any(not part.strip() for part in parts):
            raise argparse.ArgumentTypeError(f"expected ints separated by commas, got {text!r}")
        return [one(part.strip()) for part in parts]

    return parse


def output_file(text: str) -> Path:
    """A file to write the results to once the run is over: its folder must exist now (the
    results of a long run were lost to a missing folder)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist")
    return path
