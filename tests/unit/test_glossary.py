"""Every place docs/glossary.md names for a term exists: each dotted name in a row's "where" column (`module.Class`,
`module.function`, `package.module.Class.method`, relative to gradwire; the lab's relative to the repository:
`benchmarks.floor`) is imported and looked up, so a rename that
leaves the glossary behind fails here. Names of a framework that is not installed (TensorFlow, JAX, Keras) are checked
where it is."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "glossary.md"
FRAMEWORKS = ("tensorflow", "keras", "jax", "torch")


def named_places() -> list[tuple[str, str]]:
    """(term, dotted name) for every dotted name in backquotes in a row's third column that starts with a module."""
    out = []
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("term", "---") or set(cells[0]) <= {"-", ":"}:
            continue
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", cells[2]):
            name = name.removeprefix("gradwire.")
            if "." in name and name[0].islower():
                out.append((cells[0], name))
    return out


def resolve(name: str) -> object:
    """The object `name` (relative to gradwire) names: the longest importable module prefix, then attributes; an
    attribute a class's instances set (`self.x = ...`, or annotated) counts as its class's."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            lab = parts[0] == "benchmarks"  # the lab beside src/, not a module of gradwire
            found = importlib.import_module(("" if lab else "gradwire.") + ".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in FRAMEWORKS:
                pytest.skip(f"{e.name} is not installed")
            continue
        for attr in parts[cut:]:
            if hasattr(found, attr):
                found = getattr(found, attr)
            elif inspect.isclass(found) and (
                attr in getattr(found, "__annotations__", {}) or f"self.{attr} " in inspect.getsource(found)
            ):
                return found
            else:
                raise AssertionError(f"{name}: {found!r} has no {attr!r}")
        return found
    raise AssertionError(f"{name}: no module of gradwire is named by it")


PLACES = named_places()


def test_the_glossary_names_places():
    assert len(PLACES) > 80


@pytest.mark.parametrize(("term", "name"), PLACES, ids=[f"{t}:{n}" for t, n in PLACES])
def test_every_place_the_glossary_names_exists(term, name):
    assert resolve(name) is not None, term
