"""README.md stays true: every link it gives leads somewhere in this repository (or is a web address), every
`gym-ray` command line it shows names a real command and only options that command takes, and it stays a
page for users (short, no link outside the repository)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gym_ray.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "cluster" / "README.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_to_a_file_and_heading_of_this_repository(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"https?://", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.is_relative_to(REPO) or not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == []


def _command_lines() -> list[str]:
    lines = []
    for block in _CODE.findall(README.read_text(encoding="utf-8")):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("gym-ray "):
                lines.append(line)
    return lines


def test_readme_shows_every_command_of_the_cli() -> None:
    shown = {shlex.split(line)[1] for line in _command_lines()}
    assert set(build_parser().commands) <= shown | {"--version"}


@pytest.mark.parametrize("line", _command_lines())
def test_each_command_line_names_a_real_command_and_only_its_options(line: str) -> None:
    words = shlex.split(line.replace("[", " ").replace("]", " ").replace("|", " "))
    parser = build_parser()
    if words[1] == "--version":
        return
    assert words[1] in parser.commands, words[1]
    command = parser.commands[words[1]]
    options = {option for action in command._actions for option in action.option_strings}
    used = [w.split("=", 1)[0] for w in words[2:] if w.startswith("--")]
    assert [option for option in used if option not in options] == []


def test_readme_is_a_page_for_users() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 240
    assert "../" not in "".join(_LINK.findall(text))  # nothing outside the repository
    assert not re.search(r"\b(issue|touched|fresh memory)\b", text, re.I)  # no work log
