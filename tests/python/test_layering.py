"""The library's modules import only the floors below their own, and the files of one folder do not
import each other in a circle, read from the `crate::` and `super::` paths of lib/src (test code aside)."""
from __future__ import annotations

import collections
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[2] / "lib" / "src"

# The crate's top-level modules, floor by floor from the bottom: a module may import
# its own floor's neighbours only where they do not import it back, and any floor below.
FLOORS = [
    ["units", "render", "peers", "dist"],
    ["gpus"],
    ["ops"],
    ["models"],
    ["ledger"],
    ["memory"],
    ["data"],
    ["oom"],
    ["train"],
    ["learn", "measured", "checks", "smoke"],
    ["diagnose"],
    ["cli"],
]

# The rooms inside a module, floor by floor from the bottom, checked as the modules are:
# memory's probes know no card, and the card knows no report.
ROOM_FLOORS = {
    "memory": [["probes"], ["card"], ["mem_report"]],
}

# Circles that stand today, each to be cut by recutting its room: a circle not listed,
# or a listed one that grew, fails; one that shrank or went asks for its line to go too.
KNOWN_CIRCLES = {
    ("ops", frozenset({"activation", "cuda", "silu"})),
    ("ops", frozenset({"composed", "fused_norm"})),
    ("ops/cuda", frozenset({"primitives", "reference"})),
    ("ops/cpu", frozenset({"conv", "winograd"})),
}

PATH = re.compile(r"\b(crate|super(?:::super)*)::((?:[a-z_0-9]+::)*)(\{[^;]*?\}|[a-z_0-9]+)")


def without_tests(source: str) -> str:
    cut = source.find("#[cfg(test)]")
    return source if cut < 0 else source[:cut]


def module_of(path: pathlib.Path) -> tuple[str, ...]:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[:-1] if parts[-1] == "mod" else parts


def library_files() -> dict[tuple[str, ...], str]:
    files = {}
    for path in sorted(SRC.rglob("*.rs")):
        relative = path.relative_to(SRC)
        if path.name == "tests.rs" or "tests" in relative.parts[:-1] or relative.parts[0] in ("lib.rs", "bin"):
            continue
        files[module_of(path)] = without_tests(path.read_text())
    return files


def group_paths(group: str) -> list[list[str]]:
    """The paths inside `{...}`, one level deep: `{a::B, c, d::{e, f}}` gives a, c and d."""
    inner, depth, item, items = group[1:-1], 0, "", []
    for char in inner:
        depth += char == "{"
        depth -= char == "}"
        if char == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += char
    items.append(item)
    paths = []
    for entry in items:
        head = entry.strip().split(" as ")[0].split("{")[0]
        segments = [s for s in head.split("::") if re.fullmatch(r"[a-z_0-9]+", s)]
        if segments:
            paths.append(segments)
    return paths


def imports(module: tuple[str, ...], source: str, modules: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    found = set()
    for match in PATH.finditer(source):
        base, middle, tail = match.groups()
        start = [] if base == "crate" else list(module[: len(module) - base.count("super")])
        middle = [s for s in middle.split("::") if s]
        tails = group_paths(tail) if tail.startswith("{") else [[tail]]
        for rest in tails:
            path = start + middle + rest
            for n in range(len(path), 0, -1):
                if tuple(path[:n]) in modules:
                    if tuple(path[:n]) != module:
                        found.add(tuple(path[:n]))
                    break
    return found


def import_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    files = library_files()
    modules = set(files)
    return {module: imports(module, source, modules) for module, source in files.items()}


def floor_of(module: str) -> int:
    for level, names in enumerate(FLOORS):
        if module in names:
            return level
    raise AssertionError(f"lib/src/{module} is on no floor: add it to FLOORS here and to ARCHITECTURE.md's map")


def test_every_module_imports_only_its_floor_or_those_below():
    upward = sorted(
        f"{'/'.join(module)} imports {'/'.join(target)} ({target[0]} is above {module[0]})"
        for module, targets in import_graph().items()
        for target in targets
        if floor_of(target[0]) > floor_of(module[0])
    )
    assert not upward, "\n".join(upward)


def test_the_rooms_of_a_module_import_only_their_floor_or_those_below():
    def floor(module: str, room: str) -> int:
        for level, names in enumerate(ROOM_FLOORS[module]):
            if room in names:
                return level
        raise AssertionError(f"lib/src/{module}/{room} is on no floor of {module}: add it to ROOM_FLOORS")

    upward = sorted(
        f"{'/'.join(source)} imports {'/'.join(target)} ({target[1]} is above {source[1]} in {source[0]})"
        for source, targets in import_graph().items()
        if source[0] in ROOM_FLOORS and len(source) > 1
        for target in targets
        if target[0] == source[0] and len(target) > 1 and floor(target[0], target[1]) > floor(source[0], source[1])
    )
    assert not upward, "\n".join(upward)


def circles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> set[tuple[str, frozenset[str]]]:
    """Each folder's circles: its files (and subfolders) that reach each other through imports."""
    folders = {module[:-1] for module in graph}
    found = set()
    for folder in folders:
        depth = len(folder)

        def member(module: tuple[str, ...]) -> str | None:
            return module[depth] if module[:depth] == folder and len(module) > depth else None

        edges = collections.defaultdict(set)
        for module, targets in graph.items():
            source = member(module)
            for target in targets:
                sink = member(target)
                if source and sink and sink != source:
                    edges[source].add(sink)
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []

        def connect(node: str) -> None:
            index[node] = low[node] = len(index)
            stack.append(node)
            for other in edges[node]:
                if other not in index:
                    connect(other)
                    low[node] = min(low[node], low[other])
                elif other in stack:
                    low[node] = min(low[node], index[other])
            if low[node] == index[node]:
                component = set()
                while True:
                    other = stack.pop()
                    component.add(other)
                    if other == node:
                        break
                if len(component) > 1:
                    found.add(("/".join(folder) or "lib/src", frozenset(component)))

        for node in list(edges):
            if node not in index:
                connect(node)
    return found


def test_no_folder_imports_itself_in_a_circle_but_the_known_ones():
    present = circles(import_graph())
    new = sorted(f"{folder}: {', '.join(sorted(members))}" for folder, members in present - KNOWN_CIRCLES)
    gone = sorted(f"{folder}: {', '.join(sorted(members))}" for folder, members in KNOWN_CIRCLES - present)
    assert not new, "files that import each other in a circle:\n" + "\n".join(new)
    assert not gone, "these circles are cut (or changed): update KNOWN_CIRCLES:\n" + "\n".join(gone)


def test_the_reader_sees_grouped_and_relative_paths():
    modules = {("a",), ("b",), ("c",), ("c", "d"), ("e",)}
    source = "use crate::{a::X, b};\nuse super::d::Y;\nlet z = crate::e::f();"
    assert imports(("c", "g"), source, modules) == {("a",), ("b",), ("c", "d"), ("e",)}
    assert group_paths("{a::B, c, d::{e, f}}") == [["a"], ["c"], ["d"]]
