"""The layering that docs/architecture.md states, read from its table of layers, checked over the imports as written
(`import` and `from ... import` anywhere in a module, TYPE_CHECKING ones included, since they are circles to a reader).

Rules: a module imports only from its own layer or below (a module's layer is that of the longest prefix listed); one
role's package never imports another's, except the rendezvous client every node uses (gradwire.scheduler.client); no
import circles. KNOWN lists what breaks them today (empty: nothing does): a new break fails, and so does a listed
one that is gone, so that the list stays true.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gradwire"
ROLES = ("gradwire.scheduler", "gradwire.server", "gradwire.worker")
SHARED_BY_ROLES = "gradwire.scheduler.client"
KNOWN: set[str] = set()


def layers() -> list[tuple[str, list[str]]]:
    """The table of layers in docs/architecture.md (`| layer | modules ... |`): (name, module prefixes), lowest
    first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = re.search(r"^\| layer \| modules.*?\n\|---\|---\|\n((?:\|.*\|\n)+)", text, re.M)
    assert table, "docs/architecture.md has no table of layers (| layer | modules ... |)"
    out = []
    for line in table.group(1).strip().splitlines():
        name, prefixes = line.strip("|").split("|")
        out.append((name.strip(), re.findall(r"`([\w.]+)`", prefixes)))
    return out


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = ("gradwire", *path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the gradwire modules it imports (a name imported from a package that is a module counts as it)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[name] = {_owner(t, mods) for t in targets if t.split(".")[0] == "gradwire"} - {name, None}  # type: ignore[misc]
    return graph


def _owner(target: str, mods: dict[str, Path]) -> str | None:
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> tuple[int, str]:
    best = (-1, "")
    for i, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (i, prefix)
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def breaks() -> set[str]:
    table, mods = layers(), modules()
    graph = imports(mods)
    found = set()
    for module in sorted(graph):
        where = layer_of(module, table)
        assert where[0] >= 0, f"{module} is in no layer of docs/architecture.md: place it there"
        for target in graph[module]:
            to = layer_of(target, table)
            if to[0] > where[0]:
                found.add(f"up {module} ({table[where[0]][0]}) -> {target} ({table[to[0]][0]})")
            elif to[0] == where[0] and table[to[0]][0] == "roles" and to[1] != where[1] and target != SHARED_BY_ROLES:
                found.add(f"role {module} -> {target}")
    return found | {"circle " + ", ".join(c) for c in circles(graph)}


def test_the_layers_hold_and_no_import_is_circular():
    found = breaks()
    new, gone = sorted(found - KNOWN), sorted(KNOWN - found)
    assert not new, "imports against docs/architecture.md's layers:\n" + "\n".join(new)
    assert not gone, "fixed (remove them from KNOWN):\n" + "\n".join(gone)


def test_the_checker_sees_an_upward_import_and_a_circle():
    table = layers()
    assert layer_of("gradwire.worker.flow", table)[0] > layer_of("gradwire.protocol.frames", table)[0]
    assert layer_of("gradwire.admin.top", table)[0] > layer_of("gradwire.admin.metrics", table)[0]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_current_worker_is_reached_below_the_package_s_face():
    """Modules find the worker of their process through gradwire.session, never through the package's face (`import
    gradwire` then `gradwire.current_worker()`, or `from gradwire import current_worker`): an arrow back up to the
    module that imports them all."""
    through_face = []
    for name, path in modules().items():
        if name == "gradwire":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            by_attribute = (
                isinstance(node, ast.Attribute)
                and node.attr in ("current_worker", "use_worker")
                and isinstance(node.value, ast.Name)
                and node.value.id == "gradwire"
            )
            by_import = (
                isinstance(node, ast.ImportFrom)
                and node.module == "gradwire"
                and any(a.name in ("current_worker", "use_worker") for a in node.names)
            )
            if by_attribute or by_import:
                through_face.append(f"{name}:{node.lineno}")
    assert not through_face, f"the current worker reached through gradwire's face: {through_face}"


def test_nothing_in_the_package_imports_the_lab():
    """benchmarks/ (the lab, beside src/) uses the package; the package never reaches back into it, so that an installed
    gradwire, which has no lab, imports and runs everything it ships."""
    reaching = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            reaching += [f"{name} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not reaching, reaching


# Each role's data path as a pipeline, its stages in the order a call's bytes go through them (docs/architecture.md,
# "One push_pull, as data"): a stage hands its work on to the stages after it and never imports one before it, so no
# call runs back into its caller. Modules every stage shares (a role's state, its tensors) are no stage.
PIPELINES = {
    "gradwire.worker": [
        ["calls"],
        ["launching"],
        ["native_path", "link"],
        ["pushes", "answers", "link_state", "flow", "credit", "holding"],
        ["work", "handle"],
    ],
    "gradwire.server": [
        ["reader"],
        ["engine"],
        ["ops", "compressed", "optimizer_op", "landing", "seeding", "membership"],
        ["rounds"],
        ["outgoing", "replier"],
    ],
}


def arrows_back(graph: dict[str, set[str]], role: str, stages: list[list[str]]) -> list[str]:
    """Imports from a stage of `role`'s pipeline into one before it."""
    place = {f"{role}.{name}": i for i, stage in enumerate(stages) for name in stage}
    return sorted(
        f"{module} -> {target}"
        for module, at in place.items()
        for target in graph.get(module, ())
        if place.get(target, at) < at
    )


def test_each_role_s_data_path_runs_one_way():
    mods = modules()
    graph = imports(mods)
    for role, stages in PIPELINES.items():
        missing = [f"{role}.{name}" for stage in stages for name in stage if f"{role}.{name}" not in mods]
        assert not missing, f"the pipeline names modules that do not exist: {missing}"
        back = arrows_back(graph, role, stages)
        assert not back, f"{role}: a stage reaches back: {back}"


def test_the_pipeline_check_sees_an_arrow_back():
    graph = {"r.a": {"r.b"}, "r.b": {"r.c", "r.a"}, "r.c": set()}
    assert arrows_back(graph, "r", [["a"], ["b"], ["c"]]) == ["r.b -> r.a"]
