"""The package's architecture, checked statically (ast only: nothing is imported).

* no import cycle among the modules of ``synkhronos/``, counting imports inside
  functions (``import``, ``from . import x``, ``importlib.import_module("...")``);
* every module sits in the layer table (``docs/layers.txt``, which
  ``docs/internals.rst`` shows) and imports only modules of lower layers;
* no module imports a private name (``_x``) from another module, nor reads
  ``module._x`` of another module, nor ``obj._x`` of an object whose class
  another module defines;
* no module but ``context`` keeps module-level mutable state (constants and
  caches aside);
* no function in ``synkhronos/`` is longer than ``MAX_BODY_LINES`` lines.

Each failure prints every violation with ``file:line``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = "synkhronos"
#: Lines of a function's body, its docstring not counted (one screen).
MAX_BODY_LINES = 60

#: The layer table: one file, which docs/internals.rst shows as it is.
LAYER_TABLE = Path(__file__).resolve().parent.parent / "docs" / "layers.txt"


def read_layers(path: Path = LAYER_TABLE) -> dict[str, int]:
    """Module -> layer, from the layer table: ``layer  module  what it holds`` a
    line, ``#`` lines and blank lines aside. A module may import only modules
    of a strictly lower layer (a package ``__init__`` may also import its own
    submodules)."""
    out = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        layer, name = line.split(None, 2)[:2]
        if name in out:
            raise ValueError(f"{path}:{number}: {name} is in the layer table twice")
        out[name] = int(layer)
    return out


LAYERS = read_layers()

#: Modules left out of the core checks while work on them is in progress
#: (none now); the ``_everywhere`` tests run the checks on the whole package.
PENDING: tuple = ()

#: The one module allowed module-level mutable state (constants and caches aside).
CONTEXT = "synkhronos._state"
#: Calls whose result, bound to a module-level name, is mutable state.
MUTABLE_FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "count",
                     "RLock", "Lock", "Condition", "Event", "local", "WeakSet", "WeakValueDictionary",
                     "WeakKeyDictionary"}

#: Private-looking names of other objects that are public by convention.
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


# ---------------------------------------------------------------------------
# Reading the package.


def package_dir() -> Path:
    here = Path(__file__).resolve().parent
    for root in (here.parent, here / "main"):
        if (root / PACKAGE / "__init__.py").is_file():
            return root / PACKAGE
    spec = importlib.util.find_spec(PACKAGE)  # finds it without running it
    return Path(spec.origin).parent


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    root = package_dir()
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def resolve_relative(importer: str, level: int, target: str | None, mods) -> str:
    """The absolute name of ``from <level dots><target> import ...`` in ``importer``."""
    base = importer.split(".")
    if not is_package(importer, mods):
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def owner_module(name: str, mods) -> str | None:
    """The package module ``name`` is, or the closest package module containing it."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk_runtime(tree: ast.AST):
    """ast.walk, skipping ``if TYPE_CHECKING:`` blocks (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking_block(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


class Module:
    """What one module imports, binds and does with private names."""

    def __init__(self, name: str, path: Path, mods: dict[str, Path]):
        self.name, self.path, self.mods = name, path, mods
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.edges: list[tuple[str, int]] = []        # (imported package module, line)
        self.private_imports: list[tuple[str, int]] = []
        self.bound_modules: dict[str, str] = {}      # local name -> package module
        self.external: set[str] = set()               # local names bound to outside modules
        for node in _walk_runtime(self.tree):
            if isinstance(node, ast.Import):
                self._import(node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)
            elif isinstance(node, ast.Call):
                self._dynamic(node)

    def _edge(self, target: str, line: int) -> None:
        mod = owner_module(target, self.mods)
        if mod is not None and mod != self.name:
            self.edges.append((mod, line))

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != PACKAGE:
                self.external.add((alias.asname or alias.name).split(".")[0])
                continue
            self._edge(alias.name, node.lineno)
            if any(private(p) for p in alias.name.split(".")[1:]):
                self._check_private_module(alias.name, node.lineno)
            if alias.asname:
                self.bound_modules[alias.asname] = alias.name
            else:
                self.bound_modules[PACKAGE] = PACKAGE

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.level:
            source = resolve_relative(self.name, node.level, node.module, self.mods)
        else:
            source = node.module or ""
        if source.split(".")[0] != PACKAGE:
            for alias in node.names:
                self.external.add(alias.asname or alias.name)
            return
        for alias in node.names:
            full = f"{source}.{alias.name}"
            local = alias.asname or alias.name
            if full in self.mods:  # a submodule: from . import x
                self._edge(full, node.lineno)
                self.bound_modules[local] = full
                if private(alias.name):
                    self._check_private_module(full, node.lineno)
            else:
                self._edge(source, node.lineno)
                if private(alias.name) and owner_module(source, self.mods) != self.name:
                    self.private_imports.append((f"from {source} import {alias.name}", node.lineno))

    def _check_private_module(self, full: str, line: int) -> None:
        """A private module (``pkg._x``) may be imported from inside ``pkg`` only."""
        parts = full.split(".")
        for i, part in enumerate(parts):
            if private(part):
                pkg = ".".join(parts[:i])
                if not (self.name == pkg or self.name.startswith(pkg + ".")):
                    self.private_imports.append((f"import of private module {full}", line))
                return

    def _dynamic(self, node: ast.Call) -> None:
        fn = node.func
        named = (isinstance(fn, ast.Attribute) and fn.attr == "import_module") or (
            isinstance(fn, ast.Name) and fn.id in ("import_module", "__import__"))
        if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            target = node.args[0].value
            if target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                target = resolve_relative(self.name, level, target.lstrip(".") or None, self.mods)
            if target.split(".")[0] == PACKAGE:
                self._edge(target, node.lineno)

    # -- private names ------------------------------------------------------

    def owned_private(self) -> set[str]:
        """Underscore names this module defines: its globals, class members, self._x."""
        own = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                own.add(node.attr)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and private(node.value):
                own.add(node.value)  # __slots__ entries, getattr names
        return {n for n in own if private(n)}

    def private_attribute_uses(self):
        """``(kind, text, line)`` for each read of another module's private name."""
        own = self.owned_private()
        for node in _walk_runtime(self.tree):
            if not isinstance(node, ast.Attribute) or not private(node.attr):
                continue
            if node.attr in PUBLIC_UNDERSCORE:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in self.bound_modules:
                yield "module", f"{base.id}.{node.attr} ({self.bound_modules[base.id]})", node.lineno
            elif isinstance(base, ast.Name) and (base.id in self.external or base.id in ("self", "cls")):
                continue
            elif node.attr not in own:
                yield "object", f"{ast.unparse(base)}.{node.attr}", node.lineno

    # -- module-level state ----------------------------------------------------

    def module_state(self):
        """``(text, line)`` for module-level mutable state: ``global`` rebinding in a
        function, or a module-level lowercase name bound to a container, a counter,
        a lock or an instance of a class of this module (``*_cache`` names and
        UPPER_CASE constants aside)."""
        classes = {n.name for n in self.tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Global):
                yield f"global {', '.join(node.names)}", node.lineno
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            names = [n for n in names if not (n.isupper() or n.lstrip("_").isupper() or n.startswith("__")
                                              or n.lower().endswith("_cache"))]
            if names and _mutable(value, classes):
                yield f"{', '.join(names)} = {ast.unparse(value)[:60]}", node.lineno

    # -- long functions -------------------------------------------------------

    def long_functions(self):
        """``(qualified name, body lines, line)`` of functions over MAX_BODY_LINES."""
        out = []

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{child.name}"
                    body = child.body
                    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                            and isinstance(body[0].value.value, str):
                        body = body[1:]
                    n = (body[-1].end_lineno - body[0].lineno + 1) if body else 0
                    if n > MAX_BODY_LINES:
                        out.append((qual, n, child.lineno))
                    visit(child, qual + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(self.tree, "")
        return out


def _mutable(value: ast.AST, classes: set[str]) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        return name in MUTABLE_FACTORIES or name in classes
    return False


def load() -> dict[str, Module]:
    mods = modules()
    return {name: Module(name, path, mods) for name, path in mods.items()}


def where(m: Module, line: int) -> str:
    return f"{m.path.relative_to(package_dir().parent)}:{line}"


# ---------------------------------------------------------------------------
# The checks.


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def one_cycle(graph, comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``comp`` (breadth first)."""
    start, members = comp[0], set(comp)
    prev, todo = {start: None}, [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    return comp


def import_cycle_report(loaded: dict[str, Module]) -> list[str]:
    graph = {name: {t for t, _ in m.edges} for name, m in loaded.items()}
    lines = []
    for comp in cycles(graph):
        lines.append(f"cycle among {len(comp)} modules: {' -> '.join(one_cycle(graph, comp))}")
        members = set(comp)
        for name in comp:
            m = loaded[name]
            seen = set()
            for target, line in sorted(m.edges, key=lambda e: e[1]):
                if target in members and (target, line) not in seen:
                    seen.add((target, line))
                    inside = _enclosing_function(m.tree, line)
                    lines.append(f"    {where(m, line)}: {name} -> {target}"
                                 + (f"  (inside {inside})" if inside else ""))
    return lines


def _enclosing_function(tree, line: int) -> str | None:
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= node.end_lineno:
            if best is None or node.lineno > best.lineno:
                best = node
    return None if best is None else best.name + "()"


def bare_band(m: Module) -> bool:
    """A band's package whose ``__init__`` only names the band (imports nothing): no layer of its own."""
    return is_package(m.name, m.mods) and not m.edges and m.name != PACKAGE


def layer_report(loaded: dict[str, Module]) -> list[str]:
    lines = []
    for name in sorted(loaded):
        if name not in LAYERS and not bare_band(loaded[name]):
            lines.append(f"{where(loaded[name], 1)}: module {name} is not in LAYERS "
                         "(add it to docs/layers.txt)")
    for name in sorted(set(LAYERS) - set(loaded)):
        lines.append(f"LAYERS names {name}, which does not exist")
    for name, m in sorted(loaded.items()):
        if name not in LAYERS:
            continue
        for target, line in sorted(set(m.edges), key=lambda e: e[1]):
            if target not in LAYERS:
                continue
            own_sub = is_package(name, m.mods) and target.startswith(name + ".")
            if LAYERS[target] >= LAYERS[name] and not own_sub:
                lines.append(f"{where(m, line)}: {name} (layer {LAYERS[name]}) imports "
                             f"{target} (layer {LAYERS[target]})")
    return lines


def private_report(loaded: dict[str, Module], kinds=("import", "module", "object")) -> list[str]:
    lines = []
    for name, m in sorted(loaded.items()):
        found = []
        if "import" in kinds:
            found += m.private_imports
        found += [(text, line) for kind, text, line in m.private_attribute_uses() if kind in kinds]
        lines += [f"{where(m, line)}: {text}" for text, line in sorted(found, key=lambda f: f[1])]
    return lines


def state_report(loaded: dict[str, Module]) -> list[str]:
    lines = []
    for name, m in sorted(loaded.items()):
        if name == CONTEXT:
            continue
        for text, line in sorted(m.module_state(), key=lambda f: f[1]):
            lines.append(f"{where(m, line)}: {text}")
    return lines


def length_report(loaded: dict[str, Module]) -> list[str]:
    lines = []
    for name, m in sorted(loaded.items()):
        for qual, n, line in m.long_functions():
            lines.append(f"{where(m, line)}: {qual}() has {n} body lines (at most {MAX_BODY_LINES})")
    return lines


def _fail_if(lines: list[str], what: str) -> None:
    if lines:
        raise AssertionError(f"{len(lines)} {what}:\n" + "\n".join(lines))


# ---------------------------------------------------------------------------
# Tests.


def _core(lines: list[str]) -> list[str]:
    """The report without the lines that name a module of PENDING."""
    return [line for line in lines if not any(p in line for p in PENDING)]


def _private_imports(loaded):
    return private_report(loaded, kinds=("import", "module"))


def _private_attributes(loaded):
    return private_report(loaded, kinds=("object",))


#: check -> (report, what its lines are, what the PENDING work still lacks, or None)
CHECKS = {
    "cycles": (import_cycle_report, "lines about import cycles", None),
    "layers": (layer_report, "imports against the layer table", None),
    "private imports": (_private_imports,
                        "imports or module-attribute reads of another module's private names", None),
    "private attributes": (_private_attributes, "reads of private attributes defined in another module", None),
    "state": (state_report, f"module-level mutable state outside {CONTEXT}", None),
    "length": (length_report, "functions too long", None),
}


def _check(name: str, everywhere: bool = False) -> None:
    report, what, _ = CHECKS[name]
    lines = report(load())
    _fail_if(lines if everywhere else _core(lines), what)


def test_no_import_cycle():
    _check("cycles")


def test_imports_go_down_the_layers():
    _check("layers")


def test_no_private_name_imported_from_another_module():
    _check("private imports")


def test_no_private_attribute_of_another_modules_object():
    """``obj._x`` where no class or global of this module defines ``_x``: the
    object's class lives elsewhere, and ``_x`` is its private business."""
    _check("private attributes")


def test_no_module_state_outside_context():
    _check("state")


def test_functions_fit_on_a_screen():
    _check("length")


def communicator_names(path: Path) -> set[str]:
    """What ``class Communicator`` in ``path`` declares: its methods, properties and attributes."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Communicator")
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def undeclared_communicator_calls(mods: dict[str, Path], declared: set[str]) -> dict[str, list[str]]:
    """``module: method`` -> places, for each call ``<...>comm.method(...)`` or
    ``<...>inter.method(...)`` outside ``collectives/`` of a method ``declared`` lacks."""
    out: dict[str, list[str]] = {}
    for name, path in mods.items():
        if name.startswith(f"{PACKAGE}.collectives"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = ast.unparse(node.func.value)
            method = node.func.attr
            # (mpi4py's own Comm, also called ``comm`` here and there, has capitalised methods)
            if target.split(".")[-1] in ("comm", "inter") and method not in declared and not method[0].isupper():
                out.setdefault(f"{name}: {method}", []).append(f"{path.name}:{node.lineno}")
    return out


def test_outside_collectives_only_the_communicator_interface_is_called():
    """The runtime talks to every backend through the methods ``Communicator`` declares
    (collectives/base.py), so that each backend can serve every path: none other is called
    outside collectives/."""
    declared = communicator_names(package_dir() / "collectives" / "base.py")
    found = undeclared_communicator_calls(modules(), declared)
    assert not found, "calls of methods the Communicator interface does not declare:\n" + "\n".join(
        f"  {key} at {', '.join(places)}" for key, places in sorted(found.items()))


def test_an_undeclared_communicator_call_is_found(tmp_path):
    """The scan above finds a call of an undeclared method on ``comm``, ``inter`` or
    ``proc.comm`` (a scan that finds nothing proves nothing)."""
    declared = communicator_names(package_dir() / "collectives" / "base.py")
    path = tmp_path / "mod.py"
    path.write_text("def f(proc, inter):\n    proc.comm.begin(1)\n    inter.abort('x')\n"
                    "    proc.comm.all_reduce([], 'sum')\n    proc.comm.inter.Allreduce(1)\n")
    found = undeclared_communicator_calls({f"{PACKAGE}.mod": path}, declared)
    assert set(found) == {f"{PACKAGE}.mod: begin", f"{PACKAGE}.mod: abort"}, found


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if CHECKS[name][2] is None else pytest.mark.xfail(
    strict=True, reason=f"work in progress under issue 14: {CHECKS[name][2]}")) for name in CHECKS])
def test_everywhere(name):
    """The same checks on the whole package, PENDING modules included."""
    _check(name, everywhere=True)


if __name__ == "__main__":  # a report of everything, without pytest
    loaded = load()
    for title, report in (("import cycles", import_cycle_report(loaded)),
                          ("layers", layer_report(loaded)),
                          ("private imports / module attributes", private_report(loaded, ("import", "module"))),
                          ("private attributes of other modules' objects", private_report(loaded, ("object",))),
                          ("module-level mutable state", state_report(loaded)),
                          ("long functions", length_report(loaded))):
        print(f"== {title}: {len(report)}")
        print("\n".join(report))
