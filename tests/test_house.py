"""The house rules, read from the code: one folder per stage, imports only downwards, no cycles, the spec stage
free of torch and timm, lazy imports only where they defer real cost, and router kinds named in one place."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import moespec
from moespec.spec import ROUTER_KINDS

PACKAGE = Path(moespec.__file__).parent

STAGES = ["errors", "lazy", "_version", "choices", "files", "io", "layers", "spec", "routers", "backbones", "planning",
          "compiler", "weights", "distributed", "counting", "compress", "apps", "cli", "__init__"]
"""Lowest first. A module may import its own stage and the stages before it, never one after it."""

LAZY_ALLOWED = {"matplotlib", "tensorstore"}
"""Imports inside functions defer real cost here: matplotlib is optional and slow to import; tensorstore is optional
(only Orbax checkpoint folders need it, `io/orbax.py`)."""

HEAVY = {"torch", "timm", "fvcore", "numpy"}
"""Seconds to import (numpy: 0.2 s, two thirds of `import moespec.cli`, measured). A module free of them may
import them (or a moespec module that imports them) inside the functions that use them: the CLI's commands, the
router kinds' builders (`moespec --help`, `moespec schema`)."""


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
            for path in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> list[tuple[str, ast.AST, bool]]:
    """(imported moespec module or package, node, deferred?) for every import of `name`; deferred: inside a
    function or under `if TYPE_CHECKING:`, not run when `name` is imported."""
    modules = _modules()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              or isinstance(f, ast.If) and isinstance(f.test, ast.Name) and f.test.id == "TYPE_CHECKING"
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found += [(target, node, id(node) in nested) for target in targets]
    return found


def _stage(module: str) -> int:
    parts = module.split(".")
    return STAGES.index(parts[1] if len(parts) > 1 else "__init__")


def _graph() -> dict[str, set[str]]:
    modules, graph = _modules(), defaultdict(set)
    for name, path in modules.items():
        for target, _, _ in _imports(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "moespec":
                graph[name].add(target)
    return graph


def _heavy_modules() -> set[str]:
    """The moespec modules whose import imports a HEAVY package: directly, through another module, or through
    an enclosing package's __init__."""
    modules = _modules()
    runs = {name: {target for target, _, deferred in _imports(name, path) if not deferred} |
            {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)} for name, path in modules.items()}
    heavy: set[str] = set()
    while grown := {name for name, targets in runs.items() if name not in heavy
                    and any(t.split(".")[0] in HEAVY or t in heavy for t in targets)}:
        heavy |= grown
    return heavy


def test_every_module_belongs_to_a_stage():
    assert sorted({m.split(".")[1] for m in _modules() if "." in m} - set(STAGES)) == []


def test_no_stage_imports_a_later_one():
    upward = [f"{name} imports {target}" for name, targets in _graph().items() for target in targets
              if _stage(target) > _stage(name)]
    assert upward == []


def test_no_import_cycles():
    graph, index, low, stack, cycles = _graph(), {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in list(graph):
        if module not in index:
            visit(module)
    assert cycles == []


def test_the_spec_stage_imports_neither_torch_nor_timm():
    heavy = [f"{name}: {target}" for name, path in _modules().items() if name.startswith("moespec.spec")
             for target, _, _ in _imports(name, path) if target.split(".")[0] in ("torch", "timm", "fvcore")]
    assert heavy == []


def test_lazy_imports_only_defer_real_cost():
    heavy = _heavy_modules()
    lazy = [f"{name}:{node.lineno}: {target}" for name, path in _modules().items()
            for target, node, deferred in _imports(name, path)
            if deferred and target.split(".")[0] not in LAZY_ALLOWED
            and not (name not in heavy and (target.split(".")[0] in HEAVY or target in heavy))]
    assert lazy == []


def test_the_package_the_cli_and_the_router_kinds_import_no_torch():
    """What `import moespec`, `moespec --help` and validating YAML load (tests/test_cli_imports.py runs them)."""
    light = ["moespec", "moespec.cli", "moespec.spec", "moespec.routers"]
    assert [name for name in light if name in _heavy_modules()] == []


def test_only_router_kind_files_branch_on_a_router_kind():
    """Stages ask the typed router spec (`layer.router.caveats(layer)`); no module outside `routers/` compares a
    router's kind with a name, and only `routers/` spells the kinds' names (the spec also names its default)."""
    branch = re.compile(r"""kind["']?\]?\s*(==|!=|in\b)|\bisinstance\([^)]*SoftMoE""")
    names = re.compile("|".join(rf"[\"']{re.escape(kind)}[\"']" for kind in ROUTER_KINDS if kind != "image"))
    outside = [path for path in PACKAGE.rglob("*.py") if path.parent.name != "routers"]
    branching = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in outside
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if branch.search(code := line.split("#")[0]) and "router" in code]
    naming = sorted(str(path.relative_to(PACKAGE)) for path in outside if names.search(path.read_text()))
    assert branching == []
    assert naming == ["spec/compat.py"]  # DEFAULT_ROUTER_KIND: a router without `kind` is top-k


def test_no_code_reads_a_router_setting_by_name():
    """The plan carries the typed router spec: settings are attributes (`router.top_k`), never string keys
    (`router["top_k"]`, `getattr(router, "top_k")`), and no module finds a router method with getattr."""
    by_name = re.compile(r"""router\w*\[\s*["']|getattr\(\s*(self\.)?router\w*\s*,""")
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in PACKAGE.rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if by_name.search(line)]
    assert found == []


LAYER_TIERS = ["kernels", "ops", "steps", ""]
"""The tiers of `moespec.layers`, lowest first: Triton kernels, torch ops, the expert steps, then the modules the
compiler inserts (the folder itself). A tier imports its own and the tiers below it, never one above."""


def _layer_tier(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["moespec", "layers"]:
        return None
    return LAYER_TIERS.index(parts[2] if len(parts) > 2 and parts[2] in LAYER_TIERS[:-1] else "")


def test_the_layer_tiers_import_only_downwards():
    upward = [f"{name} imports {target}" for name, targets in _graph().items()
              if (tier := _layer_tier(name)) is not None
              for target in targets if (above := _layer_tier(target)) is not None and above > tier]
    assert upward == []
    assert {_layer_tier(name) for name in _modules()} >= {0, 1, 2, 3}  # every tier has modules


def test_only_the_kernels_tier_imports_triton():
    """`layers/kernels/` is the one folder that imports Triton; `layers/ops/backend.py` imports it behind one
    availability check, so that moespec imports and runs where Triton is not installed."""
    importing = sorted(name for name, path in _modules().items() for target, _, _ in _imports(name, path)
                       if target.split(".")[0] == "triton" and not name.startswith("moespec.layers.kernels"))
    assert importing == []
    backend = [name for name, path in _modules().items() for target, _, _ in _imports(name, path)
               if target.startswith("moespec.layers.kernels") and not name.startswith("moespec.layers.kernels")]
    assert sorted(set(backend)) == ["moespec.layers.ops.backend"]


def test_the_mode_is_asked_in_one_file():
    """How a layer call runs (compiling, exporting, a TorchScript trace) is asked in `layers/ops/mode.py` and
    carried down as a `Mode`; `side_by_side` checks its own thread's state (a trace among it) before it hands work
    to other threads."""
    asking = re.compile(r"\b(sync_free|exporting|traced)\(|jit\.is_tracing\(\)|is_compiling\(|is_exporting\(")
    found = sorted(f"{path.relative_to(PACKAGE)}:{number}" for path in PACKAGE.rglob("*.py")
                   for number, line in enumerate(path.read_text().splitlines(), 1)
                   if asking.search(line.split("#")[0]) and not line.lstrip().startswith("def ")
                   and path.relative_to(PACKAGE).as_posix() != "layers/ops/mode.py")
    assert [where.split(":")[0] for where in found] == ["layers/ops/side_by_side.py"], found


def test_the_steps_use_the_bank_through_its_declared_surface():
    """No step or transport reaches a private member of the expert bank (`steps/bank.py` declares what they use)."""
    private = re.compile(r"\bbank\._[a-z]")
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in (PACKAGE / "layers").rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert found == []
