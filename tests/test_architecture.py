"""The layering rule of docs/architecture.md, checked on the source: no package imports a layer above it.

Every module under src/stratagem is parsed with `ast` (nothing is imported or run). Each import of
`stratagem.<unit>` (absolute, relative, inside a function or under TYPE_CHECKING alike), and each
string constant that names a module path such as "stratagem.strategies.one_device:OneDeviceStrategy"
(the benchmark registry imports strategies by name), is an edge from the importing module's unit to
the imported one. A unit may import itself and the units of lower layers, nothing else.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stratagem"

# Bottom to top; the same table as docs/architecture.md. A unit is a subpackage or a top-level module;
# "stratagem" is the package's own __init__ (the public API, `import stratagem as sg`).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "environ", "nest"),
    ("values", "archive", "timeouts", "trace"),
    ("diagnose",),
    ("devices",),
    ("shm",),
    ("collective",),
    ("cluster",),
    ("data",),
    ("strategies",),
    ("train",),
    ("stratagem",),
    ("bench",),
    ("demo",),
    ("cli",),
    ("__main__",),
]

# Imports that break the rule on purpose, as (importing unit, imported unit): reason. Empty: the code
# as it stands follows the table everywhere.
EXCEPTIONS: dict[tuple[str, str], str] = {}

LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}
MODULE_PATH = re.compile(r"^stratagem(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_.]*)?$")


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layer unit of a dotted module name under stratagem ("stratagem" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "stratagem"


def _imported_modules(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, dotted module) for every stratagem module `path` imports or names as a module path."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "stratagem":  # `from stratagem import devices`: the names are the units
                found += [(node.lineno, f"stratagem.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value):
            named = node.value.partition(":")[0]
            if _unit(named) in LEVEL:  # not a gRPC service name such as "stratagem.ParameterServer"
                found.append((node.lineno, named))
    return [(line, m) for line, m in found if m == "stratagem" or m.startswith("stratagem.")]


def _imported_unit(module: str) -> str:
    unit = _unit(module)
    # `from stratagem import fit` names an attribute of the package, not a unit: that is the API layer.
    return unit if unit in LEVEL else "stratagem"


def _modules(src: Path = SRC) -> list[Path]:
    return sorted(src.rglob("*.py"))


def _violations(src: Path = SRC) -> list[str]:
    found = []
    for path in _modules(src):
        unit = _unit(_module_name(path, src))
        for line, module in _imported_modules(path, src):
            target = _imported_unit(module)
            if target == unit or (unit, target) in EXCEPTIONS:
                continue
            if LEVEL[target] >= LEVEL[unit]:
                found.append(f"{path.relative_to(src.parent)}:{line} ({unit}) imports {module} ({target})")
    return found


def test_every_unit_of_the_package_has_a_layer() -> None:
    units = {_unit(_module_name(path)) for path in _modules()}
    assert units - set(LEVEL) == set(), "new units must be placed in LAYERS and in docs/architecture.md"
    assert {"diagnose", "strategies", "cli"} <= units  # the walk found the package


def test_no_package_imports_a_layer_above_it() -> None:
    violations = _violations()
    assert violations == [], "imports against the layers of docs/architecture.md:\n" + "\n".join(violations)


def test_the_exceptions_listed_are_still_needed() -> None:
    edges = {
        (_unit(_module_name(path)), _imported_unit(module))
        for path in _modules()
        for _, module in _imported_modules(path)
    }
    assert set(EXCEPTIONS) <= edges, "an exception no import needs any more: remove it here and in the document"


def test_the_document_shows_the_same_layers() -> None:
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.MULTILINE)
    documented = [tuple(re.findall(r"`([^`]+)`", units)) for _, units in rows]
    expected = [tuple(u if u == "stratagem" else f"stratagem.{u}" for u in units) for units in LAYERS]
    assert documented == expected


def test_importing_the_library_loads_no_demo_module() -> None:
    # The demo sits above the library: `import stratagem` (and sg.strategy_from_env, which builds
    # strategies by name) must work without it. Checked in a fresh interpreter, on the modules
    # really loaded, so an import the parser cannot see (importlib, __import__) is caught too.
    probe = (
        "import sys, stratagem, stratagem.train, stratagem.strategies.by_name; "
        "print(sorted(m for m in sys.modules if m.startswith('stratagem.demo')))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from stratagem.train import fit\n", ["stratagem.train"]),
        ("from stratagem import devices as d, environ\n", ["stratagem.devices", "stratagem.environ"]),
        ("def f():\n    import stratagem.cli.main\n", ["stratagem.cli.main"]),
        ("PATH = 'stratagem.strategies.mirrored:MirroredStrategy'\n", ["stratagem.strategies.mirrored"]),
        ("from .buckets import GradientBuckets\n", ["stratagem.collective.buckets"]),
        ("from ..errors import InputError\n", ["stratagem.errors"]),
        ("import torch\nDOC = 'see stratagem.errors for the classes'\n", []),
        ("SERVICE = 'stratagem.ParameterServer'\n", []),
    ],
)
def test_the_parser_sees_every_kind_of_import(tmp_path: Path, source: str, expected: list[str]) -> None:
    module = tmp_path / "stratagem" / "collective" / "probe.py"  # a module of a copy of the layout
    module.parent.mkdir(parents=True)
    module.write_text(source)
    assert [m for _, m in _imported_modules(module, tmp_path / "stratagem")] == expected


def test_an_upward_import_is_reported(tmp_path: Path) -> None:
    # The check itself can fail: a diagnose module that imports strategies is named with its line.
    module = tmp_path / "stratagem" / "diagnose" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("import torch\nfrom stratagem.strategies import base\n")
    assert _violations(tmp_path / "stratagem") == [
        "stratagem/diagnose/probe.py:2 (diagnose) imports stratagem.strategies (strategies)"
    ]


# A module owns one idea and is read in one sitting; past this many lines, one of its parts becomes a module.
MAX_LINES = 500


def _long_modules(src: Path = SRC, limit: int = MAX_LINES) -> list[str]:
    """Each module of the package longer than `limit` lines, as "path: N lines"."""
    counts = [(path, len(path.read_text().splitlines())) for path in _modules(src)]
    return [f"{path.relative_to(src.parent)}: {count} lines" for path, count in counts if count > limit]


def test_no_module_is_over_500_lines() -> None:
    assert len(_modules()) > 100  # the walk found the package
    found = "\n".join(_long_modules())
    assert found == "", f"modules over {MAX_LINES} lines: move one cohesive part of each into its own module:\n{found}"


def test_a_module_over_the_limit_is_reported_with_its_line_count(tmp_path: Path) -> None:
    package = tmp_path / "stratagem" / "train"
    package.mkdir(parents=True)
    (package / "at_limit.py").write_text("x = 1\n" * 500)
    (package / "over.py").write_text("x = 1\n" * 501)
    assert _long_modules(tmp_path / "stratagem") == ["stratagem/train/over.py: 501 lines"]


def _recorded_subjects(src: Path = SRC) -> set[str]:
    """Every literal `subject=` of a `PlacementDecision(...)` call in the package."""
    subjects = set()
    for path in _modules(src):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PlacementDecision":
                for keyword in node.keywords:
                    if keyword.arg == "subject" and isinstance(keyword.value, ast.Constant):
                        subjects.add(keyword.value.value)
    return subjects


def test_every_decision_subject_is_in_the_documents_table() -> None:
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Where each placement decision is made", 1)[1].split("\n## ", 1)[0]
    documented = {
        subject
        for row in re.findall(r"^\| ([^|]+) \|", section, flags=re.MULTILINE)
        for subject in re.findall(r"`([^`]+)`", row)
    }
    recorded = _recorded_subjects()
    assert {"devices", "gradient combination", "cross-worker sums"} <= recorded  # the walk finds them
    assert recorded - documented == set(), "decision subjects missing from docs/architecture.md"


def _names_a_strategy(node: ast.AST) -> bool:
    """`strategy` or `<anything>.strategy` (a training context's, say)."""
    return (isinstance(node, ast.Name) and node.id == "strategy") or (
        isinstance(node, ast.Attribute) and node.attr == "strategy"
    )


def _strategy_reaches(path: Path) -> list[str]:
    """Where `path` reads a private member of a strategy or looks one of its members up by name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _names_a_strategy(node.value)
        ):
            found.append(f"{path.name}:{node.lineno} reads strategy.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and _names_a_strategy(node.args[0])
        ):
            found.append(f"{path.name}:{node.lineno} looks a strategy's member up with {node.func.id}")
    return found


def test_train_cli_and_bench_use_only_the_members_the_strategy_base_declares() -> None:
    # fit, evaluate, the command line and the benchmarks drive every strategy through strategies.base.Strategy.
    found = [
        reach
        for unit in ("train", "cli", "bench")
        for path in sorted((SRC / unit).rglob("*.py"))
        for reach in _strategy_reaches(path)
    ]
    assert found == [], "declare these on strategies.base.Strategy and use the declared member:\n" + "\n".join(found)


def test_a_private_read_or_a_lookup_by_name_of_a_strategy_is_reported(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(strategy, context):\n    strategy._model\n    getattr(context.strategy, 'fit_steps', None)\n"
        "    strategy.cluster\n"
    )
    assert _strategy_reaches(probe) == [
        "probe.py:2 reads strategy._model",
        "probe.py:3 looks a strategy's member up with getattr",
    ]


# The classes a strategy may subclass: the base, and the data-parallel strategies' delegation to their ReplicaSet.
STRATEGY_BASES = {
    "Strategy": "strategies/base.py",
    "ReplicatedStrategy": "strategies/data_parallel/replicated.py",
    "WorkerGroupStrategy": "strategies/worker_group/strategy.py",
}
DECLARED_INTERFACES = {"LossWeightHost", "Traceable"}
"""Declared protocols a strategy may implement beside its base (strategies/replica_context.py,
trace/traceable.py): they add members for the parts that call it, and take nothing from another strategy."""


def _strategy_classes(src: Path = SRC) -> list[tuple[Path, ast.ClassDef]]:
    found = []
    for path in _modules(src / "strategies"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and (
                node.name in STRATEGY_BASES
                or any(isinstance(b, ast.Name) and b.id.endswith("Strategy") for b in node.bases)
            ):
                found.append((path, node))
    return found


def _own_members(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its methods and class attributes, and every `self.<name> = ...` in its methods."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def _private_reads_of_others(src: Path = SRC) -> list[str]:
    """`self._x` reads, in a strategy class, of a member neither the class nor the bases it may have define."""
    classes = _strategy_classes(src)
    declared = {cls.name: _own_members(cls) for _, cls in classes if cls.name in STRATEGY_BASES}
    declared["Strategy"] = declared.get("Strategy", set())
    found = []
    for path, cls in classes:
        if cls.name in STRATEGY_BASES:
            continue
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        allowed = _own_members(cls) | declared["Strategy"] | set().union(*(declared.get(b, set()) for b in bases))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in allowed
            ):
                found.append(f"{path.relative_to(src.parent)}:{node.lineno} {cls.name} reads self.{node.attr}")
    return found


def test_no_strategy_subclasses_another_strategy() -> None:
    classes = _strategy_classes()
    assert {"MirroredStrategy", "CentralStorageStrategy", "MultiWorkerMirroredStrategy", "OneDeviceStrategy"} <= {
        cls.name for _, cls in classes
    }  # the walk finds them
    wrong = [
        f"{cls.name}({', '.join(b.id for b in cls.bases if isinstance(b, ast.Name))})"
        for _, cls in classes
        if cls.name not in STRATEGY_BASES
        and not all(isinstance(b, ast.Name) and b.id in {*STRATEGY_BASES, *DECLARED_INTERFACES} for b in cls.bases)
    ]
    assert wrong == [], "a strategy is assembled from parts, not made by editing another strategy"


def test_no_strategy_reads_private_state_it_does_not_own() -> None:
    found = _private_reads_of_others()
    assert found == [], "a strategy reads private members another class owns:\n" + "\n".join(found)


def test_a_strategy_reading_its_base_classs_private_state_is_reported(tmp_path: Path) -> None:
    strategies = tmp_path / "stratagem" / "strategies"
    strategies.mkdir(parents=True)
    (strategies / "base.py").write_text("class Strategy:\n    def close(self):\n        self._pool = None\n")
    (strategies / "probe.py").write_text(
        "class WideStrategy(Strategy):\n    def __init__(self):\n        self._mine = 1\n"
        "class NarrowStrategy(WideStrategy):\n    def explain(self):\n        return self._mine, self._pool, self._decisions\n"
    )
    assert _private_reads_of_others(tmp_path / "stratagem") == [
        "stratagem/strategies/probe.py:6 NarrowStrategy reads self._mine",
        "stratagem/strategies/probe.py:6 NarrowStrategy reads self._decisions",
    ]


# ---- no tricks on the user's objects (issue 24, item 5) -------------------------------------------
# No frame walking, no heap scanning, no method replaced on an object the library does not define the
# class of: an assignment `x.<method> = ...` (or setattr(x, "<method>", ...)) where x is not `self`, and
# <method> is a method of a torch Module, Optimizer or LR scheduler.
FORBIDDEN_CALLS = {("sys", "_getframe"), ("inspect", "currentframe"), ("gc", "get_referrers"), ("gc", "get_objects")}


def _method_names() -> frozenset[str]:
    import torch

    classes = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    return frozenset(name for cls in classes for name in dir(cls) if callable(getattr(cls, name, None)))


def _tricks(path: Path, methods: frozenset[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN_CALLS:
                found.append(f"{where}: {node.value.id}.{node.attr}")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):  # (`x.step += 1` counts, it replaces nothing)
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(item, ast.Attribute)
                    and item.attr in methods
                    and not (isinstance(item.value, ast.Name) and item.value.id in ("self", "cls"))
                ):
                    found.append(f"{where}: {ast.unparse(item)} = ...")
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("setattr", "object.__setattr__")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in methods
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
        ):
            found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_no_frame_walking_heap_scanning_or_method_replaced_on_another_object() -> None:
    methods = _method_names()
    assert {"forward", "step", "state_dict"} <= methods
    found = [trick for path in _modules() for trick in _tricks(path, methods)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import sys\nframe = sys._getframe(1)\n",
        "import gc\nowners = gc.get_referrers(x)\n",
        "module.forward = wrapper\n",
        "scheduler.step, other = a, b\n",
        "setattr(optimizer, 'zero_grad', f)\n",
    ],
)
def test_each_trick_on_a_users_object_is_reported(tmp_path: Path, source: str) -> None:
    path = tmp_path / "tricks.py"
    path.write_text(source)
    assert len(_tricks(path, _method_names())) == 1
    path.write_text("self.forward = wrapper\nmodule.weight = weight\nsetattr(parent, name, layer)\n")
    assert _tricks(path, _method_names()) == []


# ---- private members of other objects, in the whole package ---------------------------------------------
# A read (or write) `x._name` is another object's private member unless `x` is `self` or `cls`, or `_name` is
# defined by a class written in the same module (a module's helpers may use its own classes' members).
# torch's own private API (`torch._foreach_mul_`, `torch.autograd.Variable._execution_engine`) is reached
# through the imported module and is a matter apart: those reads are not counted here. namedtuple's
# documented members (`_fields`, `_replace`, ...) are public in all but name.
NAMEDTUPLE_MEMBERS = frozenset({"_fields", "_replace", "_asdict", "_make"})

# (module, attribute) pairs still allowed, each with its reason; the list only shrinks. A pair that no
# longer occurs fails `test_every_private_read_allowed_still_occurs`, so it cannot go stale.
ALLOWED_PRIVATE_READS: dict[tuple[str, str], str] = {
    # torch-private flags set on stratagem's own shard optimizers (see shared_parameters.py for why).
    ("strategies/data_parallel/cpu_threads/shared_parameters.py", "_step_supports_amp_scaling"): "user objects",
    ("strategies/data_parallel/cpu_threads/shared_parameters.py", "_need_device_dtype_check_for_fused"): "user objects",
    # A parameter's version counter, advanced by torch's in-place operations on it: the one way to see a hand-written
    # update on parameters that replicas share without copying them (hand_updates.py); torch has no public name for it.
    ("strategies/data_parallel/cpu_threads/hand_updates.py", "_version"): "torch tensors",
    # nn.Module's own tables of parameters, buffers and children, and a tensor's version counter: the replicas
    # follow what a script does to the model between steps by comparing shallow copies of these dicts in C, once
    # a step (outside_changes.py); torch's public iterators build new objects at every call, ten times slower.
    ("strategies/data_parallel/outside_changes.py", "_parameters"): "torch modules",
    ("strategies/data_parallel/outside_changes.py", "_buffers"): "torch modules",
    ("strategies/data_parallel/outside_changes.py", "_modules"): "torch modules",
    ("strategies/data_parallel/outside_changes.py", "_non_persistent_buffers_set"): "torch modules",
    ("strategies/data_parallel/outside_changes.py", "_version"): "torch tensors",
    # Whether a parameter has hooks run after its gradient is accumulated: FSDP2 reads the same attribute to decide
    # whether a unit's reduce-scatter output is read at once, and so does the deferral of one (sharded/weighting.py).
    ("strategies/sharded/weighting.py", "_post_accumulate_grad_hooks"): "torch tensors",
    # A storage's identity (its C pointer), which a meta tensor's data_ptr does not give (deferred_init.py).
    ("strategies/deferred_init.py", "_cdata"): "torch storages",
    # torch's operator overloads: their schema and the aten ops the placement log follows have no public name.
    ("diagnose/placement.py", "_schema"): "torch operators",
    ("diagnose/placement.py", "_to_copy"): "torch operators",
    ("diagnose/placement.py", "_copy_from"): "torch operators",
    ("diagnose/placement.py", "_copy_from_and_resize"): "torch operators",
    ("diagnose/placement.py", "_local_scalar_dense"): "torch operators",
    ("diagnose/soft_placement.py", "_schema"): "torch operators",
    ("strategies/data_parallel/cpu_threads/replica_random.py", "_schema"): "torch operators",
    ("strategies/data_parallel/cpu_threads/hand_updates.py", "_schema"): "torch operators",
    ("strategies/deferred_init.py", "_schema"): "torch operators",
    ("strategies/sharded/scope.py", "_schema"): "torch operators",
    # nn.Module's conversion of every tensor in place, the way torch's own `to_empty` allocates a meta model: the
    # scope allocates this rank's shards only (scope.py).
    ("strategies/sharded/scope.py", "_apply"): "torch modules",
    # The sub-command each cli module sets with argparse's set_defaults(_run=...), read by the entry point.
    ("cli/main.py", "_run"): "argparse namespace",
}


def _external_names(tree: ast.Module) -> set[str]:
    """Names bound by importing a module that is not stratagem's (`torch`, `nn`, `sys`, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("stratagem"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("stratagem"):
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _private_reads_anywhere(src: Path = SRC) -> list[tuple[str, int, str, str]]:
    """(module, line, expression, attribute) for each access to another object's private member (see above)."""
    found = []
    for path in _modules(src):
        tree = ast.parse(path.read_text(), filename=str(path))
        external = _external_names(tree)
        own = set().union(*(_own_members(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)))
        module = path.relative_to(src).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            root = _root(node.value)
            if isinstance(root, ast.Name) and root.id in external:
                continue
            if node.attr in own or node.attr in NAMEDTUPLE_MEMBERS:
                continue
            found.append((module, node.lineno, ast.unparse(node), node.attr))
    return sorted(found)


def test_no_module_reads_another_objects_private_members() -> None:
    found = _private_reads_anywhere()
    outside = [f"{m}:{line} {expr}" for m, line, expr, attr in found if (m, attr) not in ALLOWED_PRIVATE_READS]
    assert outside == [], (
        "declare what these read (a public member, or a protocol such as strategies/data_parallel/host.py) "
        "and use that:\n" + "\n".join(outside)
    )


def test_every_private_read_allowed_still_occurs() -> None:
    occurring = {(m, attr) for m, _, _, attr in _private_reads_anywhere()}
    stale = sorted(set(ALLOWED_PRIVATE_READS) - occurring)
    assert stale == [], f"remove these from ALLOWED_PRIVATE_READS: {stale}"


def test_a_private_read_of_another_object_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "stratagem"
    package.mkdir()
    (package / "probe.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Host:\n    def __init__(self):\n        self._mine = 1\n"
        "    def same(self, other):\n        return other._mine, self._theirs, cls_helper(self)\n"
        "def f(strategy, point):\n"
        "    torch._foreach_mul_, nn.modules.batchnorm._BatchNorm, point._fields\n"
        "    strategy._replicas._pool = None\n"
        "    return strategy._call_replica(), strategy._replicas\n"
    )
    assert [(line, expr) for _, line, expr, _ in _private_reads_anywhere(package)] == [
        (10, "strategy._replicas"),
        (10, "strategy._replicas._pool"),
        (11, "strategy._call_replica"),
        (11, "strategy._replicas"),
    ]


def _runs_only_for_type_checkers(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(
    body: list[ast.stmt], *, type_checking: bool = False, lazy: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: not in a function, not under ``if TYPE_CHECKING:``
    (with ``type_checking``, those too; with ``lazy``, those inside functions too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _runs_only_for_type_checkers(node.test):
            found += _import_time_imports(node.orelse, type_checking=type_checking, lazy=lazy)
            if type_checking:
                found += _import_time_imports(node.body, type_checking=type_checking, lazy=lazy)
        elif lazy or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                found += _import_time_imports(getattr(node, field, None) or [], type_checking=type_checking, lazy=lazy)
    return found


def _import_graph(src: Path = SRC, *, type_checking: bool = False, lazy: bool = False) -> dict[str, list[str]]:
    """Each module of the package and the modules of the package it imports when it is imported (with
    ``type_checking``, also under ``if TYPE_CHECKING:``; with ``lazy``, also inside functions).

    ``from package import name`` is an edge to the module ``package.name`` when there is one, else to the
    package (its ``__init__``)."""
    modules = {_module_name(path, src): path for path in _modules(src)}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_time_imports(tree.body, type_checking=type_checking, lazy=lazy):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base] * bool(base))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        # Importing a.b.c runs a.b's __init__ first: an edge to it too, unless this module is inside a.b (then
        # the package is already being imported).
        for target in list(targets):
            parts = target.split(".")
            targets.update(
                package
                for package in (".".join(parts[:end]) for end in range(2, len(parts)))
                if not (name + ".").startswith(package + ".")
            )
        graph[name] = sorted(t for t in targets if t in modules and t != name)
    return graph


def _import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_module_imports_itself_through_others_when_imported() -> None:
    graph = _import_graph()
    assert len(graph) > 100 and graph["stratagem.strategies.mirrored"]  # the walk found the package and its imports
    cycles = _import_cycles(graph)
    assert cycles == [], "import cycles (move the shared part to the module that owns it):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_an_import_cycle_is_found_and_lazy_or_type_only_imports_are_not(tmp_path: Path) -> None:
    package = tmp_path / "stratagem" / "train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from stratagem.train import b\n")
    (package / "b.py").write_text("import stratagem.train.c\n")
    (package / "c.py").write_text("try:\n    from .a import thing\nexcept ImportError:\n    pass\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stratagem.train.e import E\n"
    )
    (package / "e.py").write_text("def f():\n    from stratagem.train.d import D\n\nfrom . import d\n")
    graph = _import_graph(tmp_path / "stratagem")
    assert graph["stratagem.train.e"] == ["stratagem.train.d"] and graph["stratagem.train.d"] == []
    assert _import_cycles(graph) == [["stratagem.train.a", "stratagem.train.b", "stratagem.train.c"]]


# Import cycles among the modules of strategies/ when imports under TYPE_CHECKING and inside functions count too:
# none. Type-only cycles were broken with small Protocols declared beside the code that calls them
# (`ReplicaStrategy`, `CentralSteps`, `NativeSync`, the parameter server's `ParameterServerTasks`).
KNOWN_STRATEGY_CYCLES: list[list[str]] = []


def test_no_cycle_among_the_strategies_modules_even_for_type_checkers() -> None:
    graph = _import_graph(type_checking=True, lazy=True)
    inside = {
        module: [t for t in targets if t.startswith("stratagem.strategies")]
        for module, targets in graph.items()
        if module.startswith("stratagem.strategies")
    }
    assert len(inside) > 100
    cycles = _import_cycles(inside)
    assert cycles == KNOWN_STRATEGY_CYCLES, (
        "import cycles among strategies/ (TYPE_CHECKING and function imports counted) differ from "
        "KNOWN_STRATEGY_CYCLES: break a new one (a Protocol of the members called, beside the caller), or remove "
        "from the list one that is gone:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)
    )


def test_the_documents_tree_of_strategies_lists_every_module_and_folder() -> None:
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    block = text[text.index("```text\nstrategies/") :]
    block = block[: block.index("```", len("```text"))]
    listed = set(re.findall(r"^  ([A-Za-z_]+(?:\.py|/))", block, flags=re.MULTILINE))
    actual = {
        path.name + "/" if path.is_dir() else path.name
        for path in (SRC / "strategies").iterdir()
        if path.name != "__init__.py" and (path.suffix == ".py" or (path.is_dir() and any(path.glob("*.py"))))
    }
    assert actual - listed == set(), "modules of strategies/ missing from the tree in docs/architecture.md"
    assert listed - actual == set(), "the tree in docs/architecture.md lists what strategies/ does not hold"


def test_the_strategy_base_imports_no_strategy_folder() -> None:
    # base.py is the vocabulary every strategy shares (replica context, run inputs, gather, steps, schedulers):
    # it stands below each strategy's folder, so none of them can make a cycle through it.
    imported = [
        m for _, m in _imported_modules(SRC / "strategies" / "base.py") if m.startswith("stratagem.strategies.")
    ]
    assert imported and all(m.count(".") == 2 for m in imported), imported


def test_importing_a_module_of_a_package_counts_as_importing_the_package(tmp_path: Path) -> None:
    # q imports p.y, which runs p's __init__ first, which imports p.x, which imports q: a cycle although no
    # module names another that names it back (memory_fit and sharded/__init__ were such a pair).
    package = tmp_path / "stratagem" / "train"
    (package / "p").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "p" / "__init__.py").write_text("from stratagem.train.p import x\n")
    (package / "p" / "x.py").write_text("from stratagem.train import q\nfrom stratagem.train.p import y\n")
    (package / "p" / "y.py").write_text("")
    (package / "q.py").write_text("from stratagem.train.p.y import thing\n")
    graph = _import_graph(tmp_path / "stratagem")
    assert graph["stratagem.train.q"] == ["stratagem.train.p", "stratagem.train.p.y"]
    assert graph["stratagem.train.p.x"] == ["stratagem.train.p.y", "stratagem.train.q"]  # not its own package
    assert _import_cycles(graph) == [["stratagem.train.p", "stratagem.train.p.x", "stratagem.train.q"]]


def test_importing_the_library_loads_neither_dynamo_nor_grpc_nor_fsdp() -> None:
    # torch._dynamo costs about 2.7 s of CPU, torch.distributed.fsdp 1.2 s and grpc 0.3 s in every process of
    # every job: each loads when first used (torch.compile, an optimizer built for a parameter server, a gRPC
    # server or client, a model sharded by ShardedStrategy).
    heavy = "('torch._dynamo', 'grpc', 'torch.distributed.fsdp')"
    probe = f"import sys, stratagem; print(sorted(m for m in {heavy} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]"


def _cycles_report(prefix: str = "stratagem.strategies") -> str:
    """The import cycles among the modules under ``prefix``, counted three ways (one line each)."""
    lines = []
    for label, kwargs in (
        ("when imported", {}),
        ("when imported or type-checked", {"type_checking": True}),
        ("with imports inside functions too", {"type_checking": True, "lazy": True}),
    ):
        graph = _import_graph(**kwargs)
        inside = {
            m: [t for t in targets if t.startswith(prefix)] for m, targets in graph.items() if m.startswith(prefix)
        }
        cycles = _import_cycles(inside)
        sizes = ", ".join(str(len(c)) for c in cycles) or "none"
        lines.append(f"{prefix}, {label}: {len(cycles)} cycle(s), of {sizes} module(s)")
        lines += [f"    {' <-> '.join(c)}" for c in cycles]
    return "\n".join(lines)


if __name__ == "__main__":
    # .venv/bin/python tests/test_architecture.py [PREFIX]: the import cycles among PREFIX's modules.
    print(_cycles_report(*sys.argv[1:2]))
