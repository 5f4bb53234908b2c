"""Argument types the benchmark scripts share: a bad value is an argparse error naming the
option before anything loads or runs, not a traceback (or a table of nonsense) after it. The
integer types are ``specselect compare``'s own."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specselect.cli import int_list_option, integer_option


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``int`` option's type that refuses values below ``minimum``."""
    return integer_option("the value", minimum)  # type: ignore[no-any-return]


def int_list(minimum: int) -> Callable[[str], Any]:
    """Comma-separated ints >= ``minimum`` (``"1,8,32"``, duplicates dropped), at least one."""
    return int_list_option("the list", minimum)  # type: ignore[no-any-return]


def output_file(text: str) -> Path:
    """A file to write the results to once the run is over: its folder must exist now (the
    results of a long run were lost to a missing folder)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text!r} does not exist")
    return path
