"""The package's layers, held: every import of lowdiff's own modules points down (or within a layer), no module
imports itself back through others, bench/ and examples/ use only the public modules, and tests patch nothing of
lowdiff's (they use the fault-injection seams of ``lowdiff.testing`` instead).

The layer order is written here and in docs/reference/design.md, section 2, and nowhere else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lowdiff"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # bottom to top: a module may import its own layer and the layers above it in this list, never one below
    ("leaves", ("lowdiff.errors", "lowdiff.config")),
    ("storage: the on-disk format", ("lowdiff._storage",)),
    ("public utilities: RNG states, resumable data", ("lowdiff.rng", "lowdiff.data")),
    ("compressors", ("lowdiff._compressors",)),
    ("recovery", ("lowdiff._recovery",)),
    ("transfer: host copies, packing, the ring", ("lowdiff._transfer",)),
    ("persistence", ("lowdiff._persist",)),
    ("fault-injection seams", ("lowdiff.testing",)),
    ("training", ("lowdiff._training",)),
    ("the facade", ("lowdiff",)),
    ("integrations: the public API only", ("lowdiff.integrations",)),
)

PUBLIC = ("lowdiff", "lowdiff.config", "lowdiff.errors", "lowdiff.data", "lowdiff.rng", "lowdiff.testing",
          "lowdiff.integrations", "lowdiff.integrations.lightning", "lowdiff.integrations.transformers")
"""The modules a user (and bench/, examples/) may import; everything under a leading underscore is internal."""

MAX_LINES = 400


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The lowdiff module ``name`` refers to (a module, or a name inside one): the longest module prefix."""
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path: Path, module: str | None) -> Iterator[tuple[int, str]]:
    """(line, lowdiff module) for every import in ``path``, at any depth (in functions and TYPE_CHECKING blocks
    too: an import cycle hidden in a function is still a cycle in the design)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert module is not None, f"{path}: relative import outside the package"
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "lowdiff" or name.startswith("lowdiff."):
                target = _resolve(name)
                if target is not None and target != module:
                    yield node.lineno, target


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS (and to docs/reference/design.md)"
    return rank


def _graph() -> dict[str, dict[str, int]]:
    return {m: dict((t, line) for line, t in _imports(p, m)) for m, p in MODULES.items()}


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        for target, line in targets.items():
            # A package's __init__ may re-export its own submodules; a submodule never imports its package's
            # __init__ (that is a cycle), which find_cycles reports.
            if _layer(target) > _layer(module):
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({LAYERS[_layer(module)][0]}) "
                           f"imports {target} ({LAYERS[_layer(target)][0]}), a layer above it")
    return bad


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down_the_layers() -> None:
    bad = upward_imports(_graph())
    assert not bad, "imports that run up the layers (docs/reference/design.md, section 2):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = find_cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_an_upward_import_and_a_cycle() -> None:
    """The two checks above, on a graph with one upward import and one cycle added: both are caught."""
    graph = _graph()
    graph["lowdiff._storage.format"] = {**graph["lowdiff._storage.format"], "lowdiff._training.optimizer": 1}
    assert any("lowdiff._storage.format (storage" in b for b in upward_imports(graph))
    assert any("lowdiff._storage.format" in c and "lowdiff._training.optimizer" in c for c in find_cycles(graph))


def test_modules_stay_small() -> None:
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they do): {big}"


def test_internal_modules_are_marked_internal() -> None:
    """A module is public if it is listed in PUBLIC, else internal: then some part of its path starts with an
    underscore, so a reader of an import sees which it is."""
    unmarked = [m for m in MODULES if m not in PUBLIC and not any(
        part.startswith("_") for part in m.split(".")[1:])]
    assert not unmarked, f"modules neither public nor under a leading underscore: {unmarked}"


def _user_files() -> list[Path]:
    """bench/ and examples/, but bench/studies/: a study measures an internal on purpose (a codec's speed, the
    writer thread's hold on the GIL) and is pinned to the commit its page names (bench/studies/README.md)."""
    return sorted(p for d in ("bench", "examples") for p in (ROOT / d).rglob("*.py")
                  if "studies" not in p.relative_to(ROOT).parts)


def test_integrations_use_only_the_public_api() -> None:
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {target}" for m in MODULES
           if m.startswith("lowdiff.integrations") for line, target in _imports(MODULES[m], m) if target not in PUBLIC]
    assert not bad, "the integrations use what a user may use (PUBLIC):\n" + "\n".join(bad)


def test_bench_and_examples_use_only_public_modules() -> None:
    bad = []
    for path in _user_files():
        for line, target in _imports(path, None):
            if target not in PUBLIC:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and _chain(node.value) == "lowdiff":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: uses lowdiff.{node.attr}")
    assert not bad, "bench/ and examples/ use what a user may use (PUBLIC):\n" + "\n".join(bad)


def _chain(node: ast.AST) -> str | None:
    """``a.b.c`` as a string, for a chain of attributes on a name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _lowdiff_names(tree: ast.AST) -> set[str]:
    """Names a test file binds to lowdiff's modules or objects (``import lowdiff.x``, ``from lowdiff.x import y``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lowdiff":
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lowdiff":
            names.update(a.asname or a.name for a in node.names)
    return names


def patches_of_lowdiff(path: Path) -> list[str]:
    """Where a test file replaces something of lowdiff's: an assignment to an attribute of a lowdiff module or
    object, ``monkeypatch.setattr``/``setattr`` on one, or ``mock.patch("lowdiff...")``; also in the scripts a test
    runs in a subprocess (string constants that parse as Python and import lowdiff)."""
    tree = ast.parse(path.read_text())
    found = _patches(tree, path.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import lowdiff" in node.value:
            try:
                script = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            found += _patches(script, f"{path.name} (script at line {node.lineno})")
    return found


def _patches(tree: ast.AST, where: str) -> list[str]:
    ours = _lowdiff_names(tree)
    found = []

    def rooted(node: ast.AST) -> bool:
        chain = _chain(node)
        return chain is not None and chain.split(".")[0] in ours

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{where}:{node.lineno}: assigns {_chain(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and rooted(t.value)]
        elif isinstance(node, ast.Call):
            fn = _chain(node.func) or ""
            if fn.endswith("setattr") and node.args:
                target = node.args[0]
                if rooted(target) or (isinstance(target, ast.Constant) and str(target.value).startswith("lowdiff")):
                    found.append(f"{where}:{node.lineno}: {fn}({ast.unparse(target)}, ...)")
            if fn.split(".")[-1] in ("patch", "patch.object") and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).startswith("lowdiff"):
                found.append(f"{where}:{node.lineno}: {fn}({node.args[0].value!r})")
            if fn.endswith("patch.object") and node.args and rooted(node.args[0]):
                found.append(f"{where}:{node.lineno}: {fn}({ast.unparse(node.args[0])}, ...)")
    return found


def test_tests_patch_nothing_of_lowdiffs() -> None:
    found = [f for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__).resolve()
             for f in patches_of_lowdiff(p)]
    assert not found, ("tests replace lowdiff's internals (use the seams of lowdiff.testing, or a real fault: a "
                       "full tmpfs, a killed process):\n" + "\n".join(found))


def test_the_patch_check_catches_a_patch(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    script = "import lowdiff._persist.process_writer as pp\npp.RING_MIN_BYTES = 0\n"
    probe.write_text("import lowdiff._transfer.host_copies as hc\nfrom lowdiff._persist import child\n"
                     "def test(monkeypatch):\n    monkeypatch.setattr(hc, 'pack_host', None)\n"
                     "    child.ORPHAN_LOCK_WAIT_S = 0\n    monkeypatch.setattr('lowdiff.rng.capture', None)\n"
                     f"SCRIPT = {script!r}\n")
    assert len(patches_of_lowdiff(probe)) == 4


@pytest.mark.parametrize(("statement", "absent"), [
    ("import lowdiff", ("lowdiff._training", "lowdiff._recovery", "lowdiff._persist", "torch")),
    ("import lowdiff._recovery; lowdiff.recover", ("lowdiff._training", "lowdiff._persist", "lowdiff._transfer")),
    ("import lowdiff; lowdiff.inspect; lowdiff.verify; lowdiff.compact",
     ("lowdiff._training", "lowdiff._persist", "lowdiff._transfer")),
])
def test_what_an_import_loads(statement: str, absent: tuple[str, ...]) -> None:
    """Recovery runs without the training side (a machine with only the run directory), and ``import lowdiff``
    stays light (no torch until it is used)."""
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                            cwd=ROOT).stdout.split()
    wrong = [m for m in loaded if any(m == a or m.startswith(a + ".") for a in absent)]
    assert not wrong, f"{statement!r} loaded {wrong}"
