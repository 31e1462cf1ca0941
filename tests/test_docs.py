"""The README and the guide under docs/ hold together: every relative link and #anchor resolves, every
`dwdp ...` command they show parses with the current CLI (argparse only, nothing runs), every file path
and `dwdp.*` module they name exists, and the configuration page lists every DWDPConfig field and every
DWDP_ environment variable."""
import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest

from dwdp.cli import build_parser
from dwdp.envs import ENV_VARS
from dwdp.runtime.config import DWDPConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Other Markdown files the pages link to; their links are checked too.
LINKED_PAGES = [ROOT / "bench" / "README.md", ROOT / "traces" / "README.md"]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# A placeholder in a command: <DIR>, N, PATH, JSON, H,I,E,k ... stands for any one value.
PLACEHOLDER = re.compile(r"^(<[^>]+>|[A-Z][A-Z_]*|H,I,E,[kK])$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines with code blocks blanked, code-block lines) of a Markdown text."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            prose.append("")
            continue
        (code if fenced else prose).append(line)
        if fenced:
            prose.append("")
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lower case, punctuation removed, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs (repeats numbered as GitHub does)."""
    prose, _ = _split(path.read_text())
    found, seen = set(), {}
    for line in prose:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The targets of a page's Markdown links and images outside code."""
    prose, _ = _split(path.read_text())
    text = CODE_SPAN.sub("", "\n".join(prose))
    return LINK.findall(text)


def broken_links(path: Path) -> list[str]:
    """Why each relative link of `path` does not resolve: a missing file, or an anchor the target lacks."""
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{_rel(path)}: link {target!r}: {file_part} does not exist")
            continue
        if anchor:
            if dest.suffix != ".md":
                problems.append(f"{_rel(path)}: link {target!r}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{_rel(path)}: link {target!r}: {_rel(dest)} has no heading with anchor "
                                f"#{anchor} (it has {sorted(anchors(dest))})")
    return problems


def commands(path: Path) -> list[str]:
    """Every `dwdp ...` command a page shows: in code blocks (each `&&`, `;` or `|` segment of a line,
    comments dropped, continued lines joined) and in inline code spans."""
    prose, code = _split(path.read_text())
    found = []
    joined = re.sub(r"\\\n\s*", " ", "\n".join(code))
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        for segment in re.split(r"&&|;|\|", line):
            words = segment.strip().split()
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value dwdp ...
                words.pop(0)
            if words and words[0] == "dwdp":
                found.append(" ".join(words))
    for line in prose:
        for _, span in CODE_SPAN.findall(line):
            span = span.strip()
            if re.match(r"^dwdp(\s|$)", span):
                found.append(span)
    return found


def _subparsers(parser) -> dict:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


def _no_abbreviations(parser) -> None:
    """A page must spell every flag whole: argparse would take `--slice-size` for `--slice-sizes`."""
    parser.allow_abbrev = False
    for sub in _subparsers(parser).values():
        _no_abbreviations(sub)


def parse_problem(command: str) -> str | None:
    """None when `command` parses with the CLI; else argparse's complaint. A command made only of
    subcommand names (`dwdp tune-kernel`, `dwdp bench`, `dwdp bench ...`) names that command and is
    accepted when the names exist; a placeholder stands for one value of the option before it."""
    argv = shlex.split(command)[1:]
    if argv and argv[-1] == "...":
        argv = argv[:-1]
    argv = ["1" if PLACEHOLDER.match(word) else word for word in argv]
    parser = build_parser()
    _no_abbreviations(parser)
    walker = parser
    for word in argv:
        choices = _subparsers(walker)
        if word not in choices:
            break
        walker = choices[word]
    else:
        return None
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):  # 0: --help printed its text
                return err.getvalue().strip().splitlines()[-1]
    return None


def named_paths(path: Path) -> list[str]:
    """File paths of the repository a page names in inline code (`dwdp/runtime/model.py`, `bench/results/`)."""
    prose, _ = _split(path.read_text())
    found = []
    for line in prose:
        for _, span in CODE_SPAN.findall(line):
            for word in span.split():
                word = word.strip("(),;:'\"")
                if re.match(r"^(dwdp|kernels|tests|bench|traces|examples|docs)/[\w./*{}-]*$", word) and "{" not in word:
                    found.append(word)
    return found


def named_modules(path: Path) -> list[str]:
    """Dotted names under dwdp a page names in inline code (`dwdp.runtime.plan.coalesce`)."""
    text = CODE_SPAN.findall("\n".join(_split(path.read_text())[0]))
    return sorted({m for _, span in text for m in re.findall(r"\bdwdp(?:\.\w+)+", span)})


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT / "kernels" if parts[:2] == ["dwdp", "kernels"] else ROOT / "dwdp"
    rest = parts[2:] if parts[:2] == ["dwdp", "kernels"] else parts[1:]
    for candidate in (base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")):
        if rest and candidate.exists():
            return candidate
    return base / "__init__.py" if not rest else None


def module_problem(dotted: str) -> str | None:
    """None when `dotted` is a module of dwdp, or a name defined or imported in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        attrs = parts[cut:]
        if not attrs:
            return None
        if len(attrs) == 1 and re.search(rf"\b{re.escape(attrs[0])}\b", module.read_text()):
            return None
        return f"{dotted}: {_rel(module)} does not define {'.'.join(attrs)}"
    return f"{dotted}: no such module"


@pytest.mark.parametrize("page", PAGES + LINKED_PAGES, ids=_rel)
def test_links_and_anchors_resolve(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_dwdp_commands_parse(page):
    shown = commands(page)
    problems = [f"{_rel(page)}: `{c}`: {p}" for c in shown if (p := parse_problem(c))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_files_and_modules_exist(page):
    missing = [p for p in named_paths(page) if not list(ROOT.glob(p.rstrip("/")))]
    problems = [f"{_rel(page)}: `{p}` does not exist" for p in missing]
    problems += [f"{_rel(page)}: {p}" for m in named_modules(page) if (p := module_problem(m))]
    assert not problems, "\n".join(problems)


def test_every_page_of_the_guide_is_linked_from_its_index():
    index = {Path(t).name for t in links(ROOT / "docs" / "README.md")}
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


def test_configuration_page_lists_every_field_and_variable():
    page = (ROOT / "docs" / "configuration.md").read_text()
    fields = [f.name for f in dataclasses.fields(DWDPConfig) if f"| `{f.name}` |" not in page]
    variables = [v for v in ENV_VARS if f"| `{v}` |" not in page]
    assert not fields and not variables, f"docs/configuration.md lacks fields {fields} and variables {variables}"


def test_the_checker_sees_what_it_must():
    """The rules above, on planted text: a bad anchor, a missing file, an unknown flag and a bad choice
    are caught; placeholders, `--help` and a bare command group are not complaints."""
    assert slug("Where the overlap pays, and what stops it on a CPU: `dwdp bench regimes`") == (
        "where-the-overlap-pays-and-what-stops-it-on-a-cpu-dwdp-bench-regimes")
    assert slug("1. The technique: Distributed Weight Data Parallelism (DWDP)") == (
        "1-the-technique-distributed-weight-data-parallelism-dwdp")
    assert parse_problem("dwdp serve --ranks 2 --no-such-flag") is not None
    assert parse_problem("dwdp serve --mode neither") is not None
    assert parse_problem("dwdp tune --slice-size 4096") is not None  # --slice-sizes, abbreviated
    assert parse_problem("dwdp demo --ranks N --trace <DIR>") is None
    assert parse_problem("dwdp demo --help") is None
    assert parse_problem("dwdp bench ...") is None
    assert parse_problem("dwdp tune-kernel") is None
    assert parse_problem("dwdp tune-kernel --full") is not None  # needs one of --model, --preset, --shape
    assert parse_problem("dwdp nothing") is not None
    assert module_problem("dwdp.runtime.plan.coalesce") is None
    assert module_problem("dwdp.plan.coalesce") is not None
    assert module_problem("dwdp.kernels.launch_config") is None
