"""The layering docs/architecture.md describes, checked on the source: every import of every module
(lazy ones inside functions included) goes to the same floor or below, and there are no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# floors, bottom first: a module's floor is that of the longest name listed that it is or lies under
# ("=name": that module only, not what lies under it)
FLOORS = [
    # the schema, the choices, where artifacts live, and the registries' records
    ["=mtp_train", "mtp_train.config", "mtp_train.config_rules", "mtp_train.choices", "mtp_train.layout", "mtp_train.artifacts",
     "mtp_train.errors", "mtp_train.goals", "mtp_train.runlock", "mtp_train.instantiate",
     "=mtp_train.heads", "mtp_train.heads.registry", "=mtp_train.evaluation", "mtp_train.evaluation.modes"],
    # plain torch: models, pure tensor code, readers of what preparation leaves
    ["mtp_train.backbone", "mtp_train.adapters", "mtp_train.heads.base", "mtp_train.heads.vocab",
     "mtp_train.heads.medusa", "mtp_train.heads.chained", "mtp_train.heads.eagle3", "mtp_train.heads.persist",
     "mtp_train.losses", "mtp_train.segmentation", "mtp_train.trees", "mtp_train.depth_targets", "mtp_train.teacher",
     "mtp_train.clp", "mtp_train.data", "mtp_train.distributed", "mtp_train.checkpoint_io", "mtp_train.tracking"],
    ["mtp_train.decoding"],
    ["mtp_train.evaluation", "mtp_train.lit", "mtp_train.sweep"],
    ["mtp_train.pipeline", "mtp_train.engine", "mtp_train.report"],
    ["data_prep"],
    ["mtp_train.cli"],
]


def floor(module: str) -> int | None:
    best, where = -1, None
    for i, names in enumerate(FLOORS):
        for name in names:
            exact = name.startswith("=")
            name = name.lstrip("=")
            hit = module == name or (not exact and module.startswith(name + "."))
            if hit and len(name) > best:
                best, where = len(name), i
    return where


def modules() -> dict[str, Path]:
    out = {}
    for package in ("mtp_train", "data_prep"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_floor():
    assert [m for m in modules() if floor(m) is None] == []


def test_no_import_runs_up_a_floor():
    g = graph()
    upward = sorted(f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
                    for a, deps in g.items() for b in deps if floor(b) > floor(a))
    assert upward == []


def test_the_import_graph_has_no_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    # a package importing its own submodules for re-export is not a cycle of concern unless the
    # submodule imports the package back; both count here
    assert cycles == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself can fail: a library module importing the CLI is caught."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from mtp_train.cli.common import CONF_DIR\n")
    deps = imports(fake, "mtp_train.losses", set(modules()))
    assert "mtp_train.cli.common" in deps and floor("mtp_train.cli.common") > floor("mtp_train.losses")
