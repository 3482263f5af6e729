"""The README and docs/ stay runnable: every `cosine …` command line parses with the CLI's own
parser, every `make` target exists, every CoSineCluster shown parses, every relative link resolves,
every `cosine_` series is in the metrics page, and the README stays a page."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from cosine_spec import metric_names
from cosine_spec.cluster_spec import parse_cluster_spec

from cosine.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# An inline span that shows syntax rather than a command: [optional], a|b, FILE placeholders.
SYNTAX = re.compile(r"[\[\]|…<>]|\bFILE\b|\bR\b|\bN\b")


def _fenced(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def _command_lines(text: str) -> list[str]:
    """Shell lines of the fenced blocks, continuations joined and comments dropped."""
    lines = []
    for lang, body in _fenced(text):
        if lang not in ("", "bash", "sh", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _inline(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    return [m.group(1).strip() for m in INLINE.finditer(prose)]


def _cosine_argv(line: str) -> list[str] | None:
    """The arguments of a shell line that runs `cosine` (as its first word after any `VAR=value`),
    up to the first pipe or list operator; None for any other line."""
    first = line.split()[0] if line.split() else ""
    try:
        words = shlex.split(line)
    except ValueError:
        assert not first.endswith("cosine"), f"unbalanced quotes in `{line}`"
        return None
    while words and re.match(r"^\w+=", words[0]):
        words = words[1:]
    if not words or not (words[0] == "cosine" or words[0].endswith("/bin/cosine")):
        return None
    argv = []
    for word in words[1:]:
        if word in ("|", ";", "&&", "||", "&"):
            break
        argv.append(word)
    return argv


def _make_targets_named(line: str) -> list[str]:
    """The targets of each `make` command in a shell line (`make run RUN_ARGS=--exit` -> run)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    names, in_make = [], False
    for word in words:
        if word in (";", "&&", "||", "|"):
            in_make = False
        elif word == "make":
            in_make = True
        elif in_make and "=" not in word and not word.startswith("-"):
            names.append(word)
    return names


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([\w.-]+):(?!=)", text, re.M)}


def _parses(parser, argv: list[str], where: str) -> None:  # type: ignore[no-untyped-def]
    try:
        parser.parse_args(argv)
    except SystemExit as e:  # --help exits 0
        if e.code != 0:
            pytest.fail(f"{where} does not parse with `cosine`'s parser")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cosine_command_parses_with_the_cli(page: Path) -> None:
    """Catches: a documented flag or subcommand the CLI no longer has (or never had)."""
    text = page.read_text()
    parser = build_parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for line in _command_lines(text):
        argv = _cosine_argv(line)
        if argv is not None:
            _parses(parser, argv, f"{page.name}: `{line}`")
    for span in _inline(text):
        if not span.startswith("cosine "):
            continue
        argv = shlex.split(span)[1:]
        if SYNTAX.search(span) or (len(argv) == 1 and not argv[0].startswith("-")):  # a subcommand named
            assert argv[0] in subcommands, f"{page.name}: `{span}` names no cosine subcommand"
            continue
        _parses(parser, argv, f"{page.name}: `{span}`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_exists(page: Path) -> None:
    """Catches: a documented `make X` that the Makefile lacks."""
    targets = _makefile_targets()
    text = page.read_text()
    for line in [*_command_lines(text), *_inline(text)]:
        for name in _make_targets_named(line):
            assert name in targets, f"{page.name}: `{line}` names make target {name!r}, not in the Makefile"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cluster_shown_parses_and_every_link_resolves(page: Path) -> None:
    """Catches: a manifest in the docs the runtime would refuse; a link to a moved page."""
    text = page.read_text()
    for lang, body in _fenced(text):
        if lang == "yaml" and "kind: CoSineCluster" in body:
            for doc in yaml.safe_load_all(body):
                if isinstance(doc, dict) and doc.get("kind") == "CoSineCluster":
                    parse_cluster_spec(doc["spec"])
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"\w+://", target):
            assert (page.parent / target).exists(), f"{page.name}: link {target} resolves to nothing"


def test_the_readme_is_a_page_and_the_metrics_page_names_every_series() -> None:
    """Catches: the README growing back into a notebook; a series added without its docs."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    metrics = (ROOT / "docs" / "metrics.md").read_text()
    names = [v for k, v in vars(metric_names).items()
             if k.isupper() and isinstance(v, str) and v.startswith(("cosine_", "vllm:")) and not v.endswith("_")]
    assert names
    for name in names:
        assert f"`{name}`" in metrics or f"`{name}_total`" in metrics, name


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """Catches: extraction that finds nothing, so every check above passes vacuously."""
    sample = "```bash\nmake run\n.venv/bin/cosine serve --no-such-flag\n```\nand `cosine bench --repeat 2`"
    assert _command_lines(sample) == ["make run", ".venv/bin/cosine serve --no-such-flag"]
    assert _cosine_argv(_command_lines(sample)[1]) == ["serve", "--no-such-flag"]
    assert _inline(sample) == ["cosine bench --repeat 2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-such-flag"])
    assert {"run", "test", "bench"} <= _makefile_targets()
