"""The package's folders are its architecture: imports point one way (cli -> peer -> net -> state/tasks -> base ->
protocol), no module imports a private name of another, no import circle. A walk of every module's imports (lazy
ones inside functions included) holds it, so it stays that way."""

import ast
from pathlib import Path

import swarmrun

PACKAGE = Path(swarmrun.__file__).parent
ROOT = PACKAGE.parent

# rank of each layer: a module may import its own layer and lower ones only
LAYERS = [
    ("swarmrun.protocol", 0),
    ("swarmrun.node.output", 1), ("swarmrun.node.faults", 1), ("swarmrun.node.runtime", 1),
    ("swarmrun.node.tasks", 2), ("swarmrun.node.state", 2),
    ("swarmrun.node.net", 3),
    ("swarmrun.node.peer", 4),
    ("swarmrun.node.cli", 5), ("swarmrun.node.api", 5), ("swarmrun.coordinator", 5),
    ("swarmrun.node", 5),  # the package's lazy exports
    ("swarmrun", 6),
]


def layer(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    """(imported module, names, line) for each import of swarmrun code in the file, resolved to absolute names."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("swarmrun"):
                yield base, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("swarmrun"):
                    yield a.name, [], node.lineno


def modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def is_module(name: str, known) -> bool:
    return name in known


def test_imports_point_down_the_layers_and_name_no_private_name():
    known = modules()
    bad = []
    for me, path in known.items():
        for target, names, line in imports(path):
            for name in names or [""]:
                full = f"{target}.{name}" if name and f"{target}.{name}" in known else target
                if layer(full) > layer(me):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {full} (layer {layer(full)} > {layer(me)})")
                if name.startswith("_") and target != me:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports the private name {name} from {target}")
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    known = modules()
    graph = {m: set() for m in known}
    for me, path in known.items():
        for target, names, _ in imports(path):
            for name in names or [""]:
                full = f"{target}.{name}" if name and f"{target}.{name}" in known else target
                if full in known and full != me and not (me.startswith(full + ".") and known[full].name == "__init__.py"):
                    graph[me].add(full)
    # a package's __init__ re-exporting its submodules lazily is not an edge (swarmrun, swarmrun.node)
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_outside_code_uses_only_the_public_surface_of_node():
    """simulations/, benchmarks/ and the coordinator import only ``swarmrun.node``'s exports, never its modules
    (``from swarmrun.node import cli`` would import a module too, so each name must be an export)."""
    from swarmrun.node import __all__ as exports

    bad = []
    for folder in (ROOT / "simulations", ROOT / "benchmarks", PACKAGE / "coordinator"):
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("swarmrun.node."):
                    bad.append(f"{where} imports {node.module}")
                elif isinstance(node, ast.ImportFrom) and node.module == "swarmrun.node":
                    bad += [f"{where} imports {a.name}, not an export" for a in node.names if a.name not in exports]
                elif isinstance(node, ast.Import):
                    bad += [f"{where} imports {a.name}" for a in node.names if a.name.startswith("swarmrun.node")]
    assert not bad, "\n".join(bad)


def test_protocol_needs_only_the_stdlib_msgpack_and_blake3():
    """protocol/ is sans-IO and light (DESIGN.md's layer table): the standard library, msgpack and blake3, no numpy,
    no torch, no hivemind."""
    import sys

    allowed = set(sys.stdlib_module_names) | {"msgpack", "blake3", "swarmrun"}
    bad = []
    for path in (PACKAGE / "protocol").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] not in allowed]
    assert not bad, "\n".join(bad)


def test_modules_and_functions_stay_small():
    """No module over 500 lines, no function over 60 (a long one is split, or says why it is not), in the package
    and in the harness, the benchmarks and the examples (tests are exempt)."""
    bad = []
    for path in [*PACKAGE.rglob("*.py"), *(p for d in ("simulations", "benchmarks", "examples")
                                           for p in (ROOT / d).rglob("*.py"))]:
        text = path.read_text()
        if text.count("\n") > 500:
            bad.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not bad, "\n".join(bad)
