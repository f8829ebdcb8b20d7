"""Imports run one way (docs/CONTRACTS.md, "Layers"): core -> launcher -> trainer -> report -> ledger -> tasks ->
Airflow glue.

Every import statement of the source tree is read with `ast` (those inside functions too: a lazy import is still a
dependency), so a module that reaches up a layer, a cycle between modules, or Airflow in a layer that must run
without it fails here with the file, the line and the import. `python tests/test_layers.py` prints the import graph
by floor.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Lowest first, one folder each (the glue is Airflow's two folders): a module may import modules of its own layer
# and of the layers below. A module's layer is the deepest of these folders that holds it (tasks/report/ is the
# report's floor, the rest of tasks/ the tasks'); there is no other list.
LAYERS = (("core", ("core",)), ("launcher", ("launcher",)), ("trainer", ("trainer",)), ("report", ("tasks/report",)),
          ("ledger", ("tasks/ledger",)), ("tasks", ("tasks",)), ("airflow glue", ("plugins", "dags")))
FOLDERS = {Path(folder).parts: index for index, (_, folders) in enumerate(LAYERS) for folder in folders}
SOURCE_ROOTS = {parts[0]: REPO / parts[0] for parts in FOLDERS if len(parts) == 1}
# The worker side runs in images and on hosts without Airflow.
WITHOUT_AIRFLOW = ("core", "launcher", "trainer")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.source} imports {self.target}"


def module_name(path: Path) -> str:
    """The name a module is imported by: Airflow puts plugins/ and dags/ themselves on sys.path."""
    folder = path.relative_to(REPO).parts[0]
    root = SOURCE_ROOTS[folder] if folder in ("plugins", "dags") else REPO
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS.values() for p in root.rglob("*.py") if "__pycache__" not in p.parts)


MODULES = {module_name(path): path for path in source_files()}


def folder(module: str) -> tuple[str, ...]:
    """The deepest layer folder that holds the module."""
    parts = MODULES[module].relative_to(REPO).parts
    return max((held for held in FOLDERS if parts[:len(held)] == held), key=len)


def layer(module: str) -> int:
    return FOLDERS[folder(module)]


def project_module(name: str) -> str | None:
    """The project module an import names (`tasks.report.view`, or `tasks.report` for `from tasks.report import
    view`), else None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports() -> list[Import]:
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from tasks.report import view` imports the module tasks.report.view, not only the package.
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                           for alias in node.names]
            else:
                continue
            found += [Import(name, target, path, node.lineno) for target in targets]
    return found


IMPORTS = imports()


def test_every_layer_is_a_folder_of_the_repository():
    assert all(REPO.joinpath(*parts).is_dir() for parts in FOLDERS)
    floors = [{".".join(folder(name)) for name in MODULES if layer(name) == index} for index in range(len(LAYERS))]
    assert floors == [{"core"}, {"launcher"}, {"trainer"}, {"tasks.report"}, {"tasks.ledger"}, {"tasks"},
                      {"plugins", "dags"}]


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for item in IMPORTS:
        target = project_module(item.target)
        if target and target != item.source and layer(target) > layer(item.source):
            upward.append(f"{item} ({LAYERS[layer(item.source)][0]} -> {LAYERS[layer(target)][0]})")
    assert upward == []


def test_the_worker_side_never_imports_airflow():
    found = [str(item) for item in IMPORTS if LAYERS[layer(item.source)][0] in WITHOUT_AIRFLOW
             and (item.target == "airflow" or item.target.startswith("airflow."))]
    assert found == []


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for item in IMPORTS:
        target = project_module(item.target)
        # A package's __init__ importing its own modules is how a package exports them, not a cycle.
        if target and target != item.source and not target.startswith(item.source + "."):
            graph[item.source].add(target)
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_layer_test_sees_an_upward_import():
    """The check itself: the launcher's own modules are read, and one importing a task would be caught."""
    launcher_imports = [item for item in IMPORTS if item.source == "launcher.group"]
    assert any(item.target.startswith("launcher.") for item in launcher_imports)
    assert layer("tasks.report.view") > layer("launcher.group")
    assert layer("tasks.release") > layer("tasks.ledger.record") > layer("tasks.report.parts") > layer("trainer.train")
    assert layer("tasks.dataset.plan") == layer("tasks.release")
    assert layer("tf_multiworker.operator") > layer("tasks.release")
    assert project_module("tasks.report.fmt") == "tasks.report" and project_module("numpy") is None


def floor_graph() -> dict[tuple[str, str], int]:
    """(importing floor, imported floor) -> how many imports, between floors only."""
    arrows: dict[tuple[str, str], int] = {}
    for item in IMPORTS:
        target = project_module(item.target)
        if target and layer(target) != layer(item.source):
            key = (LAYERS[layer(item.source)][0], LAYERS[layer(target)][0])
            arrows[key] = arrows.get(key, 0) + 1
    return arrows


def test_the_floor_graph_has_arrows_downward_only():
    names = [name for name, _ in LAYERS]
    arrows = floor_graph()
    assert ("ledger", "report") in arrows and ("tasks", "ledger") in arrows  # the new floors are read
    assert [arrow for arrow in arrows if names.index(arrow[0]) < names.index(arrow[1])] == []


if __name__ == "__main__":
    for (source, target), count in sorted(floor_graph().items(), key=lambda item: [n for n, _ in LAYERS].index(
            item[0][0])):
        print(f"{source:>12} -> {target:<12} {count:4d} imports")
