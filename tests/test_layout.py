"""The package's layout holds: wings by job, imports one way between wings, no circle of imports.

Wings from the top down (a module may import its own wing and any wing below it):
  top (dwdp, __main__, cli, demo) > benchmarks > integrations > serve > tune > predict > runtime > models > observe
  > kernels > leaves (envs, versions: read by every wing, import nothing of dwdp).
Every import counts, including the ones inside functions.
"""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKS = {"leaf": 0, "kernels": 1, "observe": 2, "models": 3, "runtime": 4, "predict": 5, "tune": 6, "serve": 7,
         "integrations": 8, "benchmarks": 9, "top": 10}
TOP_MODULES = {"__init__", "__main__", "cli", "demo", "envs", "versions"}
LEAVES = {"dwdp.envs", "dwdp.versions"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = ["dwdp", *rel.parts] if rel.parts[0] == "kernels" else list(rel.parts)
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [*(ROOT / "dwdp").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the dwdp modules it imports (the innermost module each import names)."""
    edges = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def wing_of(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANKS) else "top"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({wing_of(a)}) -> {b} ({wing_of(b)})" for a, targets in edges.items() for b in targets
                  if RANKS[wing_of(a)] < RANKS[wing_of(b)])


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_only_entry_points_and_leaves_at_the_top():
    top = {p.stem for p in (ROOT / "dwdp").glob("*.py")}
    assert top == TOP_MODULES, f"modules at the top of dwdp/ besides the entry points and leaves: {sorted(top - TOP_MODULES)}"
    wings = {p.name for p in (ROOT / "dwdp").iterdir() if (p / "__init__.py").exists()}
    assert wings == set(RANKS) - {"leaf", "kernels", "top"}, sorted(wings)


def test_every_wing_says_what_it_is_for_and_what_it_may_import():
    for wing in set(RANKS) - {"leaf", "top"}:
        init = ROOT / ("kernels" if wing == "kernels" else f"dwdp/{wing}") / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in doc, f"{init.relative_to(ROOT)}'s docstring does not say what the wing may import"


def test_imports_run_one_way_between_wings():
    upward = upward_imports(_imports(_modules()))
    assert not upward, "imports from a lower wing to a higher one:\n" + "\n".join(upward)


def test_no_circle_of_imports():
    found = circles(_imports(_modules()))
    assert not found, f"modules that import each other: {found}"


def test_the_checks_see_a_planted_upward_import_and_circle():
    edges = {"dwdp.runtime.model": {"dwdp.serve.worker"}, "dwdp.serve.worker": {"dwdp.runtime.model"}}
    assert upward_imports(edges) == ["dwdp.runtime.model (runtime) -> dwdp.serve.worker (serve)"]
    assert circles(edges) == [["dwdp.runtime.model", "dwdp.serve.worker"]]
