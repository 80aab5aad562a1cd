"""docs/internals.md cannot go stale: every signature it shows is the code's, every module it maps exists.

The doc's format (stated at its top, kept simple so a merge that changes a signature fixes one line):

- A signature block is a fenced ``python`` block whose first line is ``# signatures: <module>``. Every
  ``python`` block of the doc must be one (nothing unchecked looks like a signature).
- Each entry is ``def name(params) -> ret``, ``async def name(params) -> ret`` or ``class Name(params)``
  (the constructor: for dataclasses and pydantic models, the field list). ``name`` may be
  ``Class.method`` (written without ``self``). A line indented by four spaces continues the entry above;
  ``#`` lines and anything after two spaces and ``# `` are comments.
- ``...`` as the last parameter: more parameters follow, all optional (defaults or ``*args``/``**kw``).
- ``= ...`` as a default: the parameter has a default that is computed (a factory, a module constant).
- Annotations are compared as text after dropping dotted prefixes (``typing.Any`` == ``Any``).
- Defaults are compared by value: the doc's expression is evaluated in the module's namespace.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import gym_ray

PACKAGE = Path(gym_ray.__file__).parent
DOC = PACKAGE.parent / "docs" / "internals.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_ENTRY = re.compile(r"^(?P<kind>async def|def|class) (?P<name>[A-Za-z_][\w.]*)(?P<rest>\(.*)$", re.S)
_ELIDED = re.compile(r"(?<=[,(])\s*\.\.\.\s*(?=\))")
_MORE = "__more__"


@dataclass(frozen=True)
class Entry:
    module: str
    kind: str
    name: str
    text: str

    def __str__(self) -> str:
        return f"{self.module}: {self.text}"


def _strip_comment(line: str) -> str:
    return line.split("  # ", 1)[0].rstrip()


def _entries() -> list[Entry]:
    entries = []
    for block in _FENCE.findall(DOC.read_text(encoding="utf-8")):
        lines = block.splitlines()
        head = lines[0].strip() if lines else ""
        assert head.startswith("# signatures: "), f"a python block of internals.md lacks its header: {head!r}"
        module = head.removeprefix("# signatures: ").strip()
        joined: list[str] = []
        for line in lines[1:]:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line.startswith("    ") and joined:
                joined[-1] += " " + _strip_comment(line).strip()
            else:
                joined.append(_strip_comment(line))
        for text in joined:
            match = _ENTRY.match(text)
            assert match, f"{module}: not an entry of the form 'def name(params) -> ret': {text!r}"
            entries.append(Entry(module, match["kind"], match["name"], text))
    return entries


def _normal(expr: str) -> str:
    """An annotation's text with dotted prefixes dropped and quotes/spaces normalised."""

    class Short(ast.NodeTransformer):
        def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
            return ast.Name(id=node.attr, ctx=ast.Load())

    tree = ast.parse(expr.strip(), mode="eval")
    return ast.unparse(Short().visit(tree))


def _annotation_text(annotation: Any) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return _normal(text)


@dataclass(frozen=True)
class Shown:
    params: list[inspect.Parameter]  # defaults hold the expression text, or Ellipsis for "= ..."
    more: bool
    returns: str | None


def _parse(entry: Entry) -> Shown:
    rest = _ENTRY.match(entry.text)["rest"]  # type: ignore[index]
    rest = _ELIDED.sub(f" **{_MORE}", rest, count=1)
    source = f"def _f{rest}: pass" if entry.kind != "class" else f"def _f{rest} -> None: pass"
    try:
        fn = ast.parse(source).body[0]
    except SyntaxError as exc:
        raise AssertionError(f"{entry}: the parameters do not parse ({exc.msg})") from None
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    params: list[inspect.Parameter] = []
    P = inspect.Parameter

    def add(arg: ast.arg, kind: Any, default: ast.expr | None) -> None:
        ann = _normal(ast.unparse(arg.annotation)) if arg.annotation else P.empty
        dflt: Any = P.empty if default is None else ast.unparse(default)
        params.append(P(arg.arg, kind, default=dflt, annotation=ann))

    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, arg in enumerate(positional):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        add(arg, kind, defaults[i])
    if args.vararg:
        add(args.vararg, P.VAR_POSITIONAL, None)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        add(arg, P.KEYWORD_ONLY, default)
    more = bool(args.kwarg and args.kwarg.arg == _MORE)
    if args.kwarg and not more:
        add(args.kwarg, P.VAR_KEYWORD, None)
    returns = _normal(ast.unparse(fn.returns)) if fn.returns and entry.kind != "class" else None
    return Shown(params, more, returns)


def _resolve(entry: Entry) -> tuple[Any, Any, bool]:
    """The object an entry names, its module, and whether it is a method reached through its class."""
    module = importlib.import_module(entry.module)
    owner: Any = module
    obj: Any = module
    for part in entry.name.split("."):
        owner, obj = obj, inspect.getattr_static(obj, part, None)
        assert obj is not None, f"{entry}: {entry.module} has no {entry.name}"
    is_method = owner is not module
    if isinstance(obj, staticmethod):
        obj, is_method = obj.__func__, False
    elif isinstance(obj, classmethod):
        obj = getattr(owner, entry.name.rsplit(".", 1)[1])  # bound to the class: cls is not shown
        is_method = False
    return obj, module, is_method


def _default_matches(shown: str, real: Any, namespace: dict[str, Any]) -> bool:
    if shown == "...":
        return True
    try:
        value = eval(shown, dict(namespace))
    except Exception as exc:
        raise AssertionError(f"default {shown!r} does not evaluate in the module ({exc})") from None
    return bool(value is real or value == real)


def _check(entry: Entry) -> list[str]:
    obj, module, is_method = _resolve(entry)
    shown = _parse(entry)
    problems: list[str] = []
    if entry.kind == "class":
        if not inspect.isclass(obj):
            return [f"{entry.name} is not a class"]
    else:
        if not callable(obj):
            return [f"{entry.name} is not a function"]
        is_async = inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj)
        if is_async != (entry.kind == "async def"):
            problems.append(f"{entry.name} is {'async' if is_async else 'not async'} in the code")
    signature = inspect.signature(obj)
    # Ray adds ``_ray_trace_ctx`` to the methods of a class made remote while Ray's tracing hook is on
    # (any earlier test in the same process may have done so): not part of gym_ray's signature.
    real = [p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]
    if is_method and real and real[0].name in ("self", "cls"):
        real = real[1:]
    if shown.more:
        omitted = real[len(shown.params) :]
        required = [
            p.name
            for p in omitted
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            problems.append(f"'...' hides required parameters: {', '.join(required)}")
        real = real[: len(shown.params)]
    if [(p.name, p.kind) for p in shown.params] != [(p.name, p.kind) for p in real]:
        problems.append(
            "parameters differ: doc ("
            + ", ".join(f"{p.name}:{p.kind.name}" for p in shown.params)
            + ") code ("
            + ", ".join(f"{p.name}:{p.kind.name}" for p in real)
            + ")"
        )
        return problems
    for doc_p, code_p in zip(shown.params, real, strict=True):
        if doc_p.annotation is not doc_p.empty and doc_p.annotation != _annotation_text(code_p.annotation):
            problems.append(
                f"{doc_p.name}: annotation {doc_p.annotation} in the doc, "
                f"{_annotation_text(code_p.annotation)} in the code"
            )
        if (doc_p.default is doc_p.empty) != (code_p.default is code_p.empty):
            problems.append(f"{doc_p.name}: a default in one of doc and code only")
        elif doc_p.default is not doc_p.empty and not _default_matches(
            doc_p.default, code_p.default, vars(module)
        ):
            problems.append(f"{doc_p.name}: default {doc_p.default} in the doc, {code_p.default!r} in code")
    if entry.kind != "class":
        code_returns = _annotation_text(signature.return_annotation)
        if shown.returns != code_returns:
            problems.append(f"returns {shown.returns} in the doc, {code_returns} in the code")
    return problems


ENTRIES = _entries()


def test_the_doc_shows_signatures_of_every_stage() -> None:
    modules = {e.module.split(".")[1] for e in ENTRIES}
    expected = {"config", "dispatch", "plan", "record", "run", "distributed", "streaming", "observe"}
    assert expected | {"servers", "keys", "errors", "cli"} <= modules
    assert len(ENTRIES) >= 100


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e.module}.{e.name}" for e in ENTRIES])
def test_a_signature_in_the_doc_is_the_code_s(entry: Entry) -> None:
    assert _check(entry) == [], f"docs/internals.md, {entry}"


def _doc_sections() -> dict[str, str]:
    sections: dict[str, str] = {}
    current = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].split()[0].strip("`")
            sections[current] = ""
        elif current:
            sections[current] += line + "\n"
    return sections


def test_every_module_is_on_the_map_and_every_module_on_the_map_exists() -> None:
    sections = _doc_sections()
    absent, unknown = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            continue
        if len(rel.parts) == 1:
            if rel.name != "__init__.py" and f"`{rel.name}`" not in DOC.read_text(encoding="utf-8"):
                absent.append(str(rel))
            continue
        section = sections.get(f"{rel.parts[0]}/", "")
        if f"`{rel.name}`" not in section:
            absent.append(str(rel))
    for folder, text in sections.items():
        if not folder.endswith("/"):
            continue
        for name in re.findall(r"`(\w+\.py)`", text):
            if not (PACKAGE / folder / name).exists():
                unknown.append(f"{folder}{name}")
    assert absent == [], (
        f"modules missing from docs/internals.md (name each in its folder's section): {absent}"
    )
    assert unknown == [], f"docs/internals.md names modules that do not exist: {unknown}"


def test_the_checker_catches_a_stale_signature() -> None:
    """The checker itself: a changed default, a renamed parameter, a lost async, a hidden required one."""
    good = Entry(
        "gym_ray.record.ledger",
        "def",
        "check_run",
        "def check_run(run_dir: str | os.PathLike[str], *, planned: Iterable[Identity] | None = None, ...)"
        " -> LedgerReport",
    )
    assert _check(good) == []
    stale_default = Entry(good.module, "def", good.name, good.text.replace("= None", "= ()"))
    renamed = Entry(good.module, "def", good.name, good.text.replace("planned:", "plan:"))
    made_async = Entry(good.module, "async def", good.name, "async " + good.text)
    wrong_return = Entry(good.module, "def", good.name, good.text.replace("LedgerReport", "dict"))
    for entry in (stale_default, renamed, made_async, wrong_return):
        assert _check(entry) != [], entry
    text = "def plan_run(rows: Iterable[dict[str, Any]], ...) -> RunPlan"
    hides_required = Entry("gym_ray.plan.shards", "def", "plan_run", text)
    assert _check(hides_required) == ["'...' hides required parameters: run_dir, config_identity"]
