"""The package is laid out by layer: no import circle between its modules (imports inside functions count too),
and each room (cli, measurement, serving, export...) imports only its own modules and the floors below it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = {"specrt": ROOT / "runtime", "specrt.export": ROOT / "export", "specrt.plugins": ROOT / "plugins"}
# floors, top to bottom, each a set of rooms (`specrt.<room>`); a module may import its own room and the floors
# below its own, never a floor above nor another room of its floor. A helper two floors share lives in the lower one
# (files: the staging directory of export and of the datastores).
FLOORS = [{"cli"}, {"measurement"}, {"serving", "export"}, {"decoding"}, {"engines"}, {"plugins"}, {"files"},
          {"errors"}]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] in ("export", "plugins") and prefix == "specrt":
                continue   # mapped from their own folders
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("specrt"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    # a package's __init__ is not an edge target for its submodules' own imports of siblings
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_the_walk_sees_the_package():
    g = graph()
    assert {"specrt.decoding.generate", "specrt.engines.base", "specrt.serving.server", "specrt.export.pipeline",
            "specrt.plugins.tree_attention"} <= g.keys()
    assert "specrt.engines.base" in g["specrt.decoding.generate"]


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    g = {m: {d for d in deps if d != "specrt"} for m, deps in graph().items() if m != "specrt"}
    assert _cycles(g) == []


def test_a_circle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOOR else None


def _wrong_way(g: dict[str, set[str]]) -> list[str]:
    """The arrows that go up a floor or across to another room of the same floor."""
    wrong = []
    for module, deps in g.items():
        here = _room(module)
        for dep in deps:
            there = _room(dep)
            if here and there and here != there and FLOOR[there] <= FLOOR[here]:
                wrong.append(f"{module} -> {dep}")
    return sorted(wrong)


def test_every_room_has_a_floor():
    rooms = {m.split(".")[1] for m in graph() if m.count(".") >= 1}
    assert rooms <= FLOOR.keys(), f"rooms without a floor in FLOORS: {sorted(rooms - FLOOR.keys())}"


def test_a_wrong_way_arrow_is_found():
    g = {"specrt.decoding.datastore": {"specrt.export.onnx_export", "specrt.files"},
         "specrt.serving.server": {"specrt.export.pipeline"}, "specrt.export.pipeline": {"specrt.files"},
         "specrt.files": {"specrt.errors"}, "specrt.cli": {"specrt.decoding.datastore"}}
    assert _wrong_way(g) == ["specrt.decoding.datastore -> specrt.export.onnx_export",
                             "specrt.serving.server -> specrt.export.pipeline"]


def test_runtime_layers_import_downwards():
    assert _wrong_way(graph()) == []
