"""The package's shape: a folder per stage, no import circles, one concept per module, config parsed once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gym_ray

PACKAGE = Path(gym_ray.__file__).parent
STAGES = ("config", "dispatch", "record", "finalize", "plan", "run", "distributed", "streaming", "observe")
#: Where the raw config dict may be parsed: the config package itself and the edges that take user input.
PARSERS_ALLOWED = {
    "gym_ray.config.run_config",
    "gym_ray.config.settings",
    "gym_ray.config.topology",
    "gym_ray.config.tracing",
    "gym_ray.dispatch.head",  # a client from a head server's published config
    "gym_ray.dispatch.helper",  # RolloutCollectionHelper: an edge, NeMo Gym's API takes config dicts
    "gym_ray.plan.preprocess",  # preprocess_examples(global_config_dict=...): public, NeMo Gym's signature
    "gym_ray.record.status",  # gym-ray aggregate: the CLI edge
    "gym_ray.observe.tracing",  # setup_tracing_from_config: the reference servers' own config
}
MAX_MODULE_LINES = 620  # "about 600" (STYLE.md); past it a module holds two concepts


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gym_ray"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            edges |= subs
            if node.module in modules and len(subs) < len(node.names):
                edges.add(node.module)
        elif isinstance(node, ast.Import):
            edges |= {a.name for a in node.names} & modules.keys()
    return edges


def test_every_stage_is_a_folder_with_a_docstring_and_there_is_no_internal_grab_bag() -> None:
    assert not (PACKAGE / "_internal").exists()
    for stage in STAGES:
        init = PACKAGE / stage / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring saying what the stage takes and gives"


def test_no_module_imports_itself_through_a_circle() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_module_holds_one_concept(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines; split it by concept"


def test_the_raw_config_is_parsed_only_at_the_edge() -> None:
    offenders = []
    for name, path in _modules().items():
        if name in PARSERS_ALLOWED or name.startswith(("gym_ray.bench", "gym_ray.servers")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "from_config":
                offenders.append(f"{name}:{node.lineno}")
    assert offenders == []
