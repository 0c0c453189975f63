"""Imports run down the layers only: CLI and console → runner → stages → serving and planning → layout,
profiles and version adaptations (pipeline/compat/), and never in a circle. Every import counts, the ones
inside functions too: a lazy import that runs upwards is the same knot. A stage imports no other stage:
what two stages share lives in a stage helper (STAGE_HELPERS) or further down."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("console", "pipeline.cli", "pipeline.__main__")
RUNNER = ("pipeline.runner", "pipeline.jobs", "pipeline.runview", "pipeline.runcopy", "pipeline.exporter")
STAGES = ("pipeline.stages",)
BOTTOM = ("pipeline.compat", "pipeline.rundir", "pipeline.profile", "pipeline.atomicio", "pipeline.results",
          "pipeline.decision")
STAGE_HELPERS = ("pipeline.stages.base", "pipeline.stages.served", "pipeline.stages.production")
NAMES = {4: "CLI/console", 3: "runner", 2: "stages", 1: "serving/planning", 0: "layout/profiles/compat"}


def layer(module: str) -> int:
    def under(prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)
    if under(TOP):
        return 4
    if under(RUNNER):
        return 3
    if under(STAGES):
        return 2
    if under(BOTTOM) or module == "pipeline":
        return 0
    return 1


def modules() -> dict[str, Path]:
    found = {}
    for path in [*ROOT.joinpath("pipeline").rglob("*.py"), *ROOT.joinpath("console").rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The project's modules a file imports (`from pipeline import box` names pipeline.box)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pipeline import box` names pipeline.box; `from pipeline.stages import STAGES` the package
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_imports_run_down_the_layers_only():
    known = modules()
    upward = []
    for module, path in sorted(known.items()):
        for target in imported(ast.parse(path.read_text()), set(known)):
            if target != module and layer(target) > layer(module):
                upward.append(f"{module} ({NAMES[layer(module)]}) imports {target} ({NAMES[layer(target)]})")
    assert not upward, "\n".join(upward)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imported(ast.parse(path.read_text()), set(known)) - {module} for module, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    assert not circles(graph()), "\n".join(" ↔ ".join(c) for c in circles(graph()))


def test_a_stage_imports_no_other_stage():
    stages = {m for m in modules() if m.startswith("pipeline.stages.") and m not in STAGE_HELPERS}
    crossing = [f"{module} imports {target}" for module, targets in sorted(graph().items()) if module in stages
                for target in sorted(targets & (stages | {"pipeline.stages"}))]
    assert not crossing, "\n".join(crossing)


def test_the_checks_catch_a_circle_and_a_stage_importing_a_stage():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    known = set(modules())
    lazy = ast.parse("def f():\n    from pipeline.stages import measure_production\n")
    assert imported(lazy, known) == {"pipeline.stages.measure_production"}
    assert imported(ast.parse("from pipeline.stages import STAGES\n"), known) == {"pipeline.stages"}


def test_the_layer_map_knows_every_module_and_catches_an_upward_import():
    known = modules()
    assert layer("pipeline.stages.train") == 2 and layer("pipeline.box") == 1
    assert layer("pipeline.compat.vllm_flags") == 0 and layer("console.views") == 4
    assert {"pipeline.runner", "pipeline.stages.pick_checkpoint", "pipeline.checkpoints", "console.app"} <= set(known)
    tree = ast.parse("def f():\n    from pipeline.runner import run_stages\n")
    assert imported(tree, set(known)) == {"pipeline.runner"}  # a lazy import counts
    assert layer("pipeline.runner") > layer("pipeline.stages.base")


def test_the_console_commands_the_engine_through_one_module():
    """console/commands.py alone imports what changes a run or a box (servers, port locks, notes, the runner);
    the tabs and the app read (snapshots, views) and call it."""
    known = modules()
    commanding = {"pipeline.box", "pipeline.portlock", "pipeline.notes", "pipeline.runner", "pipeline.deploy"}
    elsewhere = [f"{module} imports {target}" for module, path in sorted(known.items())
                 if module.startswith("console") and module != "console.commands"
                 for target in imported(ast.parse(path.read_text()), set(known)) & commanding]
    assert not elsewhere, "\n".join(elsewhere)
    assert imported(ast.parse(known["console.commands"].read_text()), set(known)) & commanding
