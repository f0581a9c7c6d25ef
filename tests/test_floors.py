"""pyproject's lower bounds are the versions `bash .ci/run floors` installs and runs (.ci/floors.txt), no other."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: huggingface_hub == huggingface-hub


def test_every_runtime_dependencys_floor_is_the_pinned_tested_version():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for requirement in map(Requirement, dependencies):
        (bound,) = requirement.specifier  # one lower bound each, nothing else
        assert bound.operator == ">=", requirement
        floors[_name(requirement.name)] = bound.version
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[_name(name)] = version
    assert floors == pins
