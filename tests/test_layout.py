"""The package's layout holds: wings by job, imports one way between wings, no circle of imports; every use
of a transport outside dwdp/runtime/transport/ is declared by the Transport contract; the backends are listed
once, in dwdp.runtime.transport.registry.

Wings from the top down (a module may import its own wing and any wing below it):
  top (dwdp, __main__, cli, demo) > benchmarks > integrations > serve > tune > predict > runtime > models > observe
  > kernels > leaves (envs, versions: read by every wing, import nothing of dwdp).
Every import counts, including the ones inside functions.
"""
import ast
import functools
import inspect
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


# -- the transport contract and the one backend registry ------------------------------------------------
# A transport is reached, outside dwdp/runtime/transport/ (which implements it), through a name or an
# attribute called `transport`, a parameter annotated with a Transport class, a name bound to
# make_transport(...), a `...Transport(...)` constructor or `.from_config(...)`, an element of a list called
# `transports` (subscripted, or the target of a loop over it), or a name bound to a list of constructors.
# Every attribute read or written on one must be declared by the contract, Transport (or, where the code
# built a named class itself, by that class).
TRANSPORT_PACKAGE = ROOT / "dwdp" / "runtime" / "transport"


def _transport_class_named(name: str):
    import dwdp.runtime.transport as package
    from dwdp.runtime.transport import cuda

    return getattr(package, name, None) or getattr(cuda, name, None)


def _built_class(node, classes=frozenset()) -> str | None:
    """'Transport' for an expression that makes a transport of any backend (make_transport(...), or
    from_config on a transport class: `XTransport`, transport_class(...), or a name in `classes` bound to
    one), the class name for a named constructor `XTransport(...)`, None otherwise."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Name):
        if func.id == "make_transport":
            return "Transport"
        return func.id if func.id.endswith("Transport") and func.id != "Transport" else None
    if isinstance(func, ast.Attribute) and func.attr == "from_config":
        owner = func.value
        if (isinstance(owner, ast.Name) and (owner.id.endswith("Transport") or owner.id in classes)) or (
                isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "transport_class"):
            return "Transport"
    return None


def _annotated_class(annotation) -> str | None:
    text = ast.unparse(annotation) if annotation is not None else ""
    names = [part for part in text.replace("|", " ").replace("'", " ").split() if part.endswith("Transport")]
    return names[0].rsplit(".", 1)[-1] if names else None


def _walk_own(scope):
    """The nodes of `scope` outside the functions and classes defined in it (those are scopes of their own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _transport_uses_in(scope) -> list[tuple[int, str, str]]:
    """(line, class the code holds, attribute) for every attribute access on a transport in `scope`."""
    singles: dict[str, str] = {}  # name -> class it holds
    lists: dict[str, str] = {"transports": "Transport"}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for arg in [*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs]:
            cls = _annotated_class(arg.annotation)
            if cls:
                singles[arg.arg] = cls
    nodes = list(_walk_own(scope))
    assigns = [(n.targets[0].id, n.value) for n in nodes
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)]
    classes = frozenset(target for target, value in assigns
                        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "transport_class")
    for target, value in assigns:
        element = value.elt if isinstance(value, ast.ListComp) else value.elts[0] \
            if isinstance(value, ast.List) and value.elts else None
        if _built_class(value, classes):
            singles[target] = _built_class(value, classes)
        elif _built_class(element, classes):
            lists[target] = _built_class(element, classes)
    for node in nodes:
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, ast.Name) and node.iter.id in lists:
            singles[node.target.id] = lists[node.iter.id]

    def held(node) -> str | None:
        if isinstance(node, ast.Name):
            return "Transport" if node.id == "transport" else singles.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr in ("transport", "_transport"):
            return "Transport"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return lists.get(node.value.id)
        return None

    # Aliases: `t = self.transport`, `group, transport = self.group, self.transport`.
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                else [(target, value)]
            for name, expr in pairs:
                if isinstance(name, ast.Name) and held(expr):
                    singles[name.id] = held(expr)

    return [(node.lineno, held(node.value), node.attr) for node in nodes
            if isinstance(node, ast.Attribute) and held(node.value)]


@functools.cache
def _assigned_on_self(klass: type) -> frozenset[str]:
    """The attributes the methods of `klass` (its own body) assign on self."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(klass)))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
    return frozenset(n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")


def _declared(cls_name: str, attr: str) -> bool:
    """Whether `attr` is part of what class `cls_name` (or a base of it) declares: a class attribute, an
    annotation, a method, or an attribute its methods assign on self."""
    cls = _transport_class_named(cls_name)
    assert cls is not None, f"no transport class named {cls_name}"
    return hasattr(cls, attr) or any(
        attr in vars(klass).get("__annotations__", {}) or attr in _assigned_on_self(klass)
        for klass in cls.__mro__ if klass.__module__.startswith("dwdp."))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else path.name


def transport_uses(paths) -> dict[tuple[str, str], list[str]]:
    """(class held, attribute) -> where ("module:line") for every transport use in `paths`."""
    uses = defaultdict(list)
    for path in paths:
        tree = ast.parse(path.read_text())
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                       ast.ClassDef)))]
        for scope in scopes:
            for line, cls, attr in _transport_uses_in(scope):
                where = f"{_shown(path)}:{line}"
                if where not in uses[(cls, attr)]:
                    uses[(cls, attr)].append(where)
    return uses


def undeclared_transport_uses(paths) -> list[str]:
    return sorted(f"{', '.join(where)}: {cls}.{attr}" for (cls, attr), where in transport_uses(paths).items()
                  if not _declared(cls, attr))


def _callers() -> list[Path]:
    return [p for p in (ROOT / "dwdp").rglob("*.py") if TRANSPORT_PACKAGE not in p.parents]


def test_everything_used_of_a_transport_is_declared_on_the_contract():
    uses = transport_uses(_callers())
    used = {attr for cls, attr in uses if cls == "Transport"}
    # The walk sees the calls the runtime makes (else it would pass by seeing nothing).
    assert {"submit", "release_slot", "register", "open", "seal", "close", "forget_peer", "open_peer",
            "fail_copies_from", "can_rejoin", "board_handle", "peer_segment", "recorder", "name", "alloc_segment",
            "alloc_slot", "composite_views", "granularity", "describe_mapping", "nvtx_ranges"} <= used, sorted(used)
    undeclared = undeclared_transport_uses(_callers())
    assert not undeclared, "used on a transport but not declared by its class:\n" + "\n".join(undeclared)


def test_the_contract_check_sees_an_undeclared_call(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(self, transport: 'Transport', plan):\n"
                       "    transport.submit(plan, None)\n    self.transport.flush_all()\n"
                       "    own = CudaTransport(0)\n    own.copy_batches = 2\n    own.warp_speed = 1\n"
                       "    t = self.transport\n    t.rewind()\n")
    assert undeclared_transport_uses([planted]) == ["planted.py:3: Transport.flush_all",
                                                    "planted.py:6: CudaTransport.warp_speed",
                                                    "planted.py:8: Transport.rewind"]


def backend_lists(paths, backends) -> list[str]:
    """Places that name two or more backends in one literal (a tuple, list, set, or dict keys), pick one
    of two backends by a condition, or compare a backend with a backend's name: each is a list of the
    backends kept outside dwdp.runtime.transport.registry."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in backends]
            elif isinstance(node, ast.Dict):
                names = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in backends]
            elif isinstance(node, ast.IfExp):
                names = [e.value for e in (node.body, node.orelse) if isinstance(e, ast.Constant)
                         and e.value in backends]
            elif isinstance(node, ast.Compare) and isinstance(node.left, (ast.Name, ast.Attribute)) \
                    and "backend" in ast.unparse(node.left):
                names = [c.value for c in node.comparators if isinstance(c, ast.Constant) and c.value in backends]
                names *= 2  # one name is enough: the comparison is a branch per backend
            else:
                continue
            if len(names) >= 2:
                found.append(f"{_shown(path)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_one_backend_registry():
    from dwdp.runtime.transport.registry import TRANSPORTS

    assert {"host", "cuda"} <= set(TRANSPORTS)
    paths = [*(ROOT / "dwdp").rglob("*.py")]
    found = backend_lists(paths, set(TRANSPORTS))
    assert not found, "backend lists outside dwdp.runtime.transport.registry:\n" + "\n".join(found)


def test_the_registry_check_sees_planted_backend_lists(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('BACKENDS = ("auto", "host", "cuda")\nSLICES = {"host": 1, "cuda": 4}\n'
                       'b = "cuda" if on_gpu else "host"\nif backend == "cuda":\n    pass\n'
                       'DEVICES = ("cpu", "cuda")\n')
    assert [f.split(":")[1] for f in backend_lists([planted], {"host", "cuda"})] == ["1", "2", "3", "4"]
