"""Docs that cannot rot: in README.md and docs/*.md, every relative link resolves (the file, and
its #anchor to a heading by GitHub's slug rule), and every `python -m concatfl…` command shown
(code blocks and inline code) is accepted by that module's argument parser. A rename breaks
this suite, not the reader. Nothing runs: the parsers only read the arguments."""

from __future__ import annotations

import io
import itertools
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from functools import cache
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"\s*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)", re.S)  # within a paragraph
HEADING = re.compile(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*")
LINK = re.compile(r"\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
COMMAND = re.compile(r"\bpython3?\s+-m\s+(concatfl[\w.]*)")
LOGICAL_LINE = re.compile(r"(?:[^\n]*\\\n)*[^\n]*")  # lines ending in \ continue
OPTIONAL = re.compile(r"\[(-[^][]*)\]")  # usage notation: [--flag VALUE]
PLACEHOLDER_SPAN = re.compile(r"<[^<>\n]+>")  # <its --port>: one word, not redirections
OPERATOR = re.compile(r"[|&;()]+|\d*>.*|<")  # where the command ends; `#` comments are dropped by shlex
EXPANSION = re.compile(r"\$(\w*|\{\w+\})")  # a whole word known only when the shell runs ($VAR, $(…))
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|<[\w-]+>")  # a value to fill in (PID, N, <port>): parsed as 1


def split_code(text: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The lines outside fenced code blocks (those inside blanked, so numbers hold) and the
    code shown: [(first line, text)] of every fenced block and inline code span."""
    lines, blocks, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None and (opening := FENCE.match(line)):
            fence = opening.group(1)
            blocks.append((number + 1, []))
        elif fence is not None and re.fullmatch(rf"\s*{fence}{fence[0]}*\s*", line):
            fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
        else:
            lines.append(line)
            continue
        lines.append("")
    prose = "\n".join(lines)
    spans = [(prose.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ")) for m in INLINE_CODE.finditer(prose)]
    return lines, sorted([(start, "\n".join(block)) for start, block in blocks] + spans)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, without what is not a letter, digit,
    space, '-' or '_', spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading))
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(doc: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one gets -1, -2, …"""
    found = set()
    for line in split_code(doc.read_text())[0]:
        if heading := HEADING.fullmatch(line):
            base = anchor = slug(heading.group(1))
            for n in itertools.count(1):
                if anchor not in found:
                    break
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def broken_links(doc: Path) -> list[str]:
    """`doc:line: target: why` for each relative link (outside code) that does not resolve."""
    prose = "\n".join(split_code(doc.read_text())[0])
    prose = INLINE_CODE.sub(lambda span: re.sub(r"[^\n]", " ", span.group()), prose)  # keeps line numbers
    problems = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http(s), mailto, …
            continue
        path, _, anchor = unquote(target).partition("#")
        file = doc.parent / path if path else doc
        line = prose.count("\n", 0, match.start()) + 1
        where = f"{doc.name}:{line}: ({target})"
        if not file.exists():
            problems.append(f"{where}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.resolve()):
            problems.append(f"{where}: no heading #{anchor} in {file.name}")
    return problems


def argv_of(words: str) -> list[str] | None:
    """The arguments a shell would pass, up to the first operator or redirection; None when a
    whole argument is an expansion, known only when the shell runs."""
    words = PLACEHOLDER_SPAN.sub(lambda span: shlex.quote(span.group()), OPTIONAL.sub(r"\1", words))
    lexer = shlex.shlex(words, posix=True, punctuation_chars="|&;()")
    lexer.whitespace_split = True
    argv = list(itertools.takewhile(lambda word: not OPERATOR.fullmatch(word), lexer))
    return None if any(EXPANSION.fullmatch(word) for word in argv) else argv


def parse(module: str, argv: list[str]) -> None:
    """Read `argv` as `python -m module` does before running anything (SystemExit when refused)."""
    match module, argv[:1]:
        case "concatfl.bench", ["overhead" | "scale" as suite]:  # bench's main hands these over
            import_module(f"concatfl.bench.{suite}").parse_options(argv[1:])
        case "concatfl.bench", ["soak"]:
            import_module("concatfl.bench.soak").build_parser().parse_args(argv[1:])
        case "concatfl.bench", _:
            import_module("concatfl.bench.__main__").build_parser().parse_args(argv)
        case "concatfl.launch", _:
            import_module(module).build_parser().parse_args(argv)
        case "concatfl.deployment.warm_executor", _:
            import_module(module).parse_args(argv)
        case "concatfl.deployment.supernode", _:  # flower-supernode's flags, plus the launcher's own
            from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

            flag = import_module(module).WARM_EXECUTOR_FLAG
            _parse_args_run_supernode().parse_args([word for word in argv if word != flag])
        case _:
            raise SystemExit(f"no parser known for python -m {module}: add it to parse() in {Path(__file__).name}")


def refusal(module: str, argv: list[str] | None) -> str | None:
    """Why `python -m module argv` would be refused, or None. Without arguments (the module
    named in prose, or arguments only the shell knows), only that the module exists."""
    try:
        if find_spec(module) is None:
            return "no such module"
    except ModuleNotFoundError:
        return "no such module"
    if not argv:
        return None
    errors = io.StringIO()
    try:
        with redirect_stderr(errors), redirect_stdout(io.StringIO()):
            parse(module, ["1" if PLACEHOLDER.fullmatch(word) else word for word in argv])
    except SystemExit as exit_:
        if exit_.code:
            message = (errors.getvalue().strip() or str(exit_.code)).splitlines()[-1]
            if "invalid choice: '1'" in message and "1" not in argv:  # a placeholder (SUITE) where a name goes
                return None
            return message.partition("error: ")[2] or message
    return None


def refused_commands(doc: Path) -> list[str]:
    """`doc:line: command: why` for each `python -m concatfl…` shown that its parser refuses."""
    problems = []
    for first_line, code in split_code(doc.read_text())[1]:
        for command in COMMAND.finditer(code):
            words = LOGICAL_LINE.match(code, command.end()).group().replace("\\\n", " ")
            try:
                argv = argv_of(words)
            except ValueError as error:  # from shlex: unbalanced quotes
                why = f"cannot split it into arguments: {error}"
            else:
                why = refusal(command.group(1), argv)
            if why:
                line = first_line + code.count("\n", 0, command.start())
                shown = " ".join(f"{command.group()} {words}".split())
                problems.append(f"{doc.name}:{line}: {shown}: {why}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_links_resolve(doc):
    problems = broken_links(doc)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_commands_parse(doc):
    problems = refused_commands(doc)
    assert not problems, "commands their parser refuses:\n" + "\n".join(problems)


def test_the_checks_see_rot(tmp_path):
    """Both checks on a made-up document: what resolves passes, each rotten thing is named."""
    (tmp_path / "other.md").write_text("# Other\n\n## Sub-heading: `code` & Ünïcode!\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## Same\n\n## Same\n\n"
        "[a](other.md) ![b](other.md#sub-heading-code--ünïcode) [c](#same-1) [d](https://x.invalid/#no)\n"
        "[e](gone.md) [f](other.md#same) [g](#same-2) [h](#not-a-heading) `[i](gone.md)`\n\n"
        "```bash\n# Not a heading\n[j](gone.md)\n"
        "FOO=1 .venv/bin/python -m concatfl.launch --num-supernodes 2 \\\n"
        "    --run-config \"seed=1\" 2>&1 | tee log   # the run's log\n"
        "for s in a b; do python -m concatfl.bench $s --bogus; done\n```\n\n"
        "Run `python -m concatfl.launch --num-nodes\n2` or `python -m concatfl.gone`, and\n"
        "`python -m concatfl.deployment.warm_executor --runtime-api-address <head>:9094 --insecure\n"
        "[--parent-pid PID]`.\n"
    )
    assert broken_links(doc) == [
        "doc.md:8: (gone.md): no such file",
        "doc.md:8: (other.md#same): no heading #same in other.md",
        "doc.md:8: (#same-2): no heading #same-2 in doc.md",
        "doc.md:8: (#not-a-heading): no heading #not-a-heading in doc.md",
    ]
    assert refused_commands(doc) == [
        "doc.md:18: python -m concatfl.launch --num-nodes 2: unrecognized arguments: --num-nodes 2",
        "doc.md:19: python -m concatfl.gone: no such module",
    ]
