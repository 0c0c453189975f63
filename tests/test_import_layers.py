"""Imports run down the layers only, and never in a circle: CLI and console → the run (pipeline/run/) → stages →
report → planning → evaluation → serving → the host, the data and the trainer's process → layout, profiles and
version adaptations (pipeline/compat/). A package is its layer (LAYERS). Every import counts, the ones inside
functions too: a lazy import that runs upwards is the same knot. A stage imports no other stage: what two stages
share lives in a stage helper (STAGE_HELPERS) or further down."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package (or module) → layer; a module is its longest entry's. `pipeline` names the package itself only: a
# module new at pipeline/'s top has no layer until it gets an entry (or goes into a package).
LAYERS = {
    "console": 8, "pipeline.cli": 8, "pipeline.__main__": 8,
    "pipeline.run": 7,
    "pipeline.stages": 6,
    "pipeline.report": 5,      # the run's report, plots, the published head's card
    "pipeline.planning": 4,    # the plan, calibration, preflight: they read what serving and evaluation will do
    "pipeline.evaluation": 3,  # the offline evaluator, prompt lookup, the k schedule, diagnosis
    "pipeline.serving": 2,     # vLLM servers, their ports and argv, the HTTP client, Mooncake
    "pipeline.host": 1, "pipeline.data": 1,  # GPUs, process groups, port locks; conversations, the target
    "pipeline.training": 1,    # the trainer's own process: its launcher, the nodes' agreement
    "pipeline.layout": 0, "pipeline.profile": 0, "pipeline.compat": 0, "pipeline": 0,
    "pipeline.units": 0,       # GIB, bytes and parameter counts as people read them
}
ITSELF_ONLY = {"pipeline"}
STAGE_HELPERS = ("pipeline.stages.base", "pipeline.stages.served", "pipeline.stages.production",
                 "pipeline.stages.benchmark", "pipeline.stages.heads")
NAMES = {8: "CLI/console", 7: "run", 6: "stages", 5: "report", 4: "planning", 3: "evaluation", 2: "serving",
         1: "host/data/training", 0: "layout/profile/compat"}


def owner(module: str) -> str | None:
    """The LAYERS entry a module belongs to: the longest that is it or a package above it; None if none is."""
    entries = [e for e in LAYERS if module == e or (e not in ITSELF_ONLY and module.startswith(e + "."))]
    return max(entries, key=len, default=None)


def layer(module: str) -> int:
    entry = owner(module)
    assert entry is not None, f"{module} is in no package of LAYERS: give it one"
    return LAYERS[entry]


def modules() -> dict[str, Path]:
    found = {}
    for path in [*ROOT.joinpath("pipeline").rglob("*.py"), *ROOT.joinpath("console").rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The project's modules a file imports (`from pipeline.serving import ports` names pipeline.serving.ports)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pipeline.serving import ports` names pipeline.serving.ports;
            # `from pipeline.stages import STAGES` the package
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


def test_every_module_belongs_to_one_package_of_the_map():
    known = modules()
    homeless = sorted(m for m in known if owner(m) is None)
    assert not homeless, "in no package of LAYERS (move each into a package, or add an entry): " + ", ".join(homeless)
    unused = sorted(e for e in LAYERS if not any(owner(m) == e for m in known))
    assert not unused, "LAYERS entries no module belongs to (moved or gone?): " + ", ".join(unused)


def test_the_layer_map_knows_every_module_and_catches_an_upward_import():
    known = modules()
    assert owner("pipeline.newcomer") is None and owner("pipeline") == "pipeline"  # a new top module has no layer
    assert owner("pipeline.run.runner") == "pipeline.run" and owner("console.tabs.gpus") == "console"
    assert layer("pipeline.stages.train") == 6 and layer("pipeline.serving.ports") == 2
    assert layer("pipeline.host.gpu") == 1 and layer("pipeline.data.targetinfo") == 1
    assert layer("pipeline.compat.vllm_flags") == 0 and layer("console.views") == 8
    assert layer("pipeline.layout.rundir") == 0 and layer("pipeline.profile") == 0
    assert {"pipeline.run.runner", "pipeline.stages.pick_checkpoint", "pipeline.layout.checkpoints",
            "console.app"} <= set(known)
    tree = ast.parse("def f():\n    from pipeline.run.runner import run_stages\n")
    assert imported(tree, set(known)) == {"pipeline.run.runner"}  # a lazy import counts
    tree = ast.parse("from pipeline.serving import ports\n")
    assert imported(tree, set(known)) == {"pipeline.serving.ports"}  # a module from its package
    assert layer("pipeline.run.runner") > layer("pipeline.stages.base")


def test_the_console_commands_the_engine_through_one_module():
    """console/commands.py alone imports what changes a run or a box (servers, port locks, notes, the runner);
    the tabs and the app read (snapshots, views) and call it."""
    known = modules()
    commanding = {"pipeline.serving.ports", "pipeline.host.portlock", "pipeline.report.notes", "pipeline.run.runner",
                  "pipeline.serving.deploy"}
    elsewhere = [f"{module} imports {target}" for module, path in sorted(known.items())
                 if module.startswith("console") and module != "console.commands"
                 for target in imported(ast.parse(path.read_text()), set(known)) & commanding]
    assert not elsewhere, "\n".join(elsewhere)
    assert imported(ast.parse(known["console.commands"].read_text()), set(known)) & commanding
