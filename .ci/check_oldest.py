"""Check that .ci/oldest.txt pins exactly the floors of pyproject.toml's dependencies.

CI tests the oldest supported versions by installing .ci/oldest.txt; a floor raised in
pyproject.toml but not there (or the reverse) would test versions the package does not declare.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def floors() -> dict[str, str]:
    """``{name: version}`` for every ``name>=version`` in pyproject.toml's dependencies.

    Read from the installed package's metadata (run this in a venv where it is installed), which
    lists them as pyproject.toml does; extras carry a marker and are left out.
    """
    found = {}
    for requirement in requires("specselect") or ():
        if ";" in requirement:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", requirement)
        if match is None:
            sys.exit(f"pyproject.toml: dependency {requirement!r} is not of the form name>=version")
        found[match[1].lower()] = match[2]
    return found


def pins() -> dict[str, str]:
    """``{name: version}`` for every ``name==version`` line of .ci/oldest.txt."""
    found = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].partition("==")
        if name.strip():
            found[name.strip().lower()] = version.strip()
    return found


def release(version: str) -> tuple[int, ...]:
    """``"1.26.0"`` -> ``(1, 26)``: a floor ``>=1.26`` and a pin ``==1.26.0`` name one release."""
    parts = [int(part) for part in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


if __name__ == "__main__":
    floor, pin = floors(), pins()
    wrong = [
        f"{name}: floor {floor.get(name, 'none')}, pinned {pin.get(name, 'none')}"
        for name in sorted(floor.keys() | pin.keys())
        if name not in floor or name not in pin or release(floor[name]) != release(pin[name])
    ]
    if wrong:
        sys.exit(f".ci/oldest.txt must pin exactly pyproject.toml's floors: {'; '.join(wrong)}")
