"""The README and the pages under docs/ stay alive: every relative link resolves (to a file
or folder of the repository, and an ``#anchor`` to a heading of the page it names), every
repository path they name in code exists, and every command shown in a fenced code block
still parses the way a user would type it.

What "still parses" means, command by command (nothing is run):

* ``diloco-ray SUB ...`` and ``python -m diloco_ray SUB ...``: the real CLI parser
  (:func:`diloco_ray.cli.build_parser`) accepts the arguments; with a config file of the
  repository, the config loads with its ``--set`` values (as ``diloco-ray train`` does before
  Ray starts). A command shown with a ``diloco-ray: error: ...`` line under it must fail with
  that message, so an example of a wrong command stays wrong in the documented way.
* ``python bench/X.py ...``: the file exists and the flags are ones its argparse parser
  declares (the parser is rebuilt from the file's ``add_argument`` calls, so the bench's
  heavy imports are not paid).
* ``python -m MODULE``: the module can be found.
* ``--set FIELD=VALUE`` and ``--grid FIELD=...`` anywhere: ``FIELD`` is a config field.
* a path under configs/, cluster/, bench/, tests/, docs/ or diloco_ray/: it exists.

Upper-case words (``CONFIG.yaml``, ``OUTPUT_DIR``, ``N``, ``KEY=VALUE``) and bracketed
optional parts (``[--set KEY=VALUE ...]``) are placeholders of a usage line, not values.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import itertools
import os
import pathlib
import re
import shlex
import tempfile

import pytest

from diloco_ray.cli import build_parser
from diloco_ray.config.fields import FIELD_NAMES
from diloco_ray.config.schema import TrainerConfig, parse_set
from diloco_ray.errors import UserInputError
from diloco_ray.observe import events, records

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
# Pages whose links are checked too (their commands are other tools' or generated).
LINKED_ONLY = ["ARCHITECTURE.md", "BENCHMARKS.md", "cluster/README.md"]
MAX_README_LINES = 400

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)")
REPO_PATH = re.compile(r"^(?:\./)?(?:configs|cluster|bench|tests|docs|diloco_ray)/[\w./-]*$")
INLINE_PATH = re.compile(r"`((?:configs|cluster|bench|tests|docs|diloco_ray)/[\w./-]+\.(?:py|yaml|json|sh|md|png))`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[./][\w./]*)?$")  # CONFIG.yaml, OUTPUT_DIR/sweep, N
SHELL_BLOCKS = {"bash", "sh", "shell"}  # every line a command; other blocks: only "$ " lines
OPERATORS = {"&&", "||", ";", "|"}


# ----------------------------------------------------------------------------- pages


def fenced_blocks(text: str):
    """``(language, [lines])`` of every fenced code block of a markdown text."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, body = m.group(2), m.group(3).lower(), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield lang, body
        i += 1


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown page's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(text: str, page: str) -> list[str]:
    """Relative links of ``text`` (the page at ``page``, relative to the root) that do not
    resolve: a missing file or folder, or an anchor that is no heading of its page."""
    problems = []
    here = (ROOT / page).parent
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https://, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (here / path).resolve() if path else ROOT / page
        if path and not dest.exists():
            problems.append(f"{page}: link to missing {target}")
            continue
        if anchor and dest.suffix == ".md":
            dest_text = text if not path else dest.read_text()
            if anchor not in anchors(dest_text):
                problems.append(f"{page}: link to {target}: no heading '#{anchor}' there")
    return problems


def path_exists(path: str) -> bool:
    """A repository path, or one relative to the package (``algo/topk.py``)."""
    path = path.removeprefix("./").rstrip("/")
    return (ROOT / path).exists() or (ROOT / "diloco_ray" / path).exists()


def inline_path_problems(text: str, page: str) -> list[str]:
    """Repository files named in inline code (`` `bench/wan.py` ``) that do not exist."""
    return [f"{page}: names missing {p}" for p in INLINE_PATH.findall(prose(text)) if not path_exists(p)]


# ----------------------------------------------------------------------------- commands


def commands(text: str):
    """``(command line, documented error or None)`` for every command of the page's code
    blocks: each line of a shell block, each ``$ `` line of another (with the
    ``diloco-ray: error:`` line printed under it, if any); continuation lines joined."""
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_BLOCKS | {"", "console", "text"}:
            continue  # python, yaml, json: not shell commands
        joined: list[str] = []
        for line in body:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line)
        for i, line in enumerate(joined):
            stripped = line.strip()
            if stripped.startswith("$ "):
                after = joined[i + 1].strip() if i + 1 < len(joined) else ""
                error = after.removeprefix("diloco-ray: error: ") if after.startswith("diloco-ray: error: ") else None
                yield stripped[2:], error
            elif lang in SHELL_BLOCKS and stripped and not stripped.startswith("#"):
                yield stripped, None


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: split at ``&&``/``;``/``|``, without comments,
    optional ``[...]`` parts, ``...``, leading ``sudo``/``VAR=value``; a ``ray job submit``
    contributes the command after its ``--`` too."""
    line = re.sub(r"(?<=\s)\[--[^\]]*\]", " ", line)  # [--set KEY=VALUE ...], [--grid ...]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            parts.append([])
        elif token != "...":
            parts[-1].append(token)
    out = []
    for words in parts:
        while words and (words[0] == "sudo" or re.match(r"^[A-Za-z_]\w*=", words[0])):
            words = words[1:]
        if not words:
            continue
        out.append(words)
        if words[:3] == ["ray", "job", "submit"] and "--" in words:
            out.append(words[words.index("--") + 1 :])
    return out


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)


def bench_parser(path: pathlib.Path) -> argparse.ArgumentParser:
    """An argparse parser with the arguments ``path`` declares (its ``add_argument`` calls,
    read from the source), so a bench's flags are checked without importing it."""
    parser = _Parser(prog=path.name)
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg in ("action", "nargs", "choices", "dest", "required"):
                with contextlib.suppress(ValueError):
                    kwargs[kw.arg] = ast.literal_eval(kw.value)
            elif kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                kwargs["type"] = {"int": int, "float": float}[kw.value.id]
        parser.add_argument(*names, **kwargs)
    return parser


def field_problems(words: list[str]) -> list[str]:
    """``--set``/``--grid`` keys that are no config field (placeholders aside)."""
    problems = []
    for flag, value in zip(words, words[1:]):
        if flag in ("--set", "--grid"):
            key = value.partition("=")[0].split(".")[0]
            if not PLACEHOLDER.match(key) and key not in FIELD_NAMES:
                problems.append(f"{flag} {value}: no config field '{key}'")
    return problems


def check_cli(args: list[str], error) -> list[str]:
    """A ``diloco-ray`` command line (without the program name) against the real parser and,
    with a config file of the repository, the config it loads."""
    args = ["2" if a in ("N", "R") else a for a in args]  # counts in a usage line
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parsed = build_parser().parse_args(args)
    except SystemExit as e:  # --help
        return [] if e.code == 0 else [f"diloco-ray {' '.join(args)}: exit {e.code}"]
    except UserInputError as e:
        return [] if error and e.args[0].startswith(error) else [f"diloco-ray {' '.join(args)}: {e.args[0]}"]
    config = getattr(parsed, "config", None)
    if config is None or PLACEHOLDER.match(config) or not (ROOT / config).is_file():
        return [] if error is None else [f"diloco-ray {' '.join(args)}: shown failing, but parses"]
    try:
        overrides = parse_set(parsed.overrides)
        if error is None:
            TrainerConfig.from_yaml(str(ROOT / config), overrides=overrides)
        else:  # a wrong example may need the checks train runs before Ray (into a fresh folder)
            with tempfile.TemporaryDirectory() as tmp:
                out = {**overrides, "output_dir": os.path.join(tmp, "run")}
                cfg = TrainerConfig.from_yaml(str(ROOT / config), overrides=out)
                from diloco_ray.driver import preflight  # torch: only for an example the config accepts

                preflight.check(cfg, resuming=False)
    except UserInputError as e:
        message = e.args[0]
        if error is not None and message.startswith(error.removesuffix("...").rstrip()):
            return []
        return [f"diloco-ray {' '.join(args)}: {message}"]
    return [] if error is None else [f"diloco-ray {' '.join(args)}: shown failing with '{error}', but loads"]


def command_problems(text: str, page: str) -> list[str]:
    """Every command of ``text``'s code blocks that no longer parses (see the module docstring)."""
    problems = []
    for line, error in commands(text):
        for words in simple_commands(line):
            found = field_problems(words) if error is None else []  # a wrong example: check_cli
            found += [f"names missing {w}" for w in words if REPO_PATH.match(w) and not path_exists(w)]
            program, rest = words[0], words[1:]
            if program in ("python", "python3") and rest[:2] == ["-m", "diloco_ray"]:
                program, rest = "diloco-ray", rest[2:]
            if program == "diloco-ray":
                found += check_cli(rest, error)
            elif program in ("python", "python3") and rest[:1] == ["-m"] and len(rest) > 1:
                if importlib.util.find_spec(rest[1]) is None:
                    found.append(f"no module {rest[1]}")
            elif program in ("python", "python3") and rest and rest[0].endswith(".py"):
                script = ROOT / rest[0]
                if not script.is_file():
                    found += [] if REPO_PATH.match(rest[0]) else [f"no file {rest[0]}"]  # else named above
                else:
                    try:
                        bench_parser(script).parse_args(rest[1:])
                    except _Refused as e:
                        found.append(f"{rest[0]}: {e}")
            problems += [f"{page}: `{line}`: {p}" for p in found]
    return problems


# ----------------------------------------------------------------------------- the tests


def test_the_readme_is_a_guide_and_docs_holds_the_rest():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES
    assert len(PAGES) - 1 >= 3
    readme = (ROOT / "README.md").read_text()
    linked = {str((ROOT / t.partition("#")[0]).resolve().relative_to(ROOT)) for t in LINK.findall(readme)}
    assert [p for p in PAGES[1:] if p not in linked] == [], "every docs page is linked from the README"


@pytest.mark.parametrize("page", PAGES + LINKED_ONLY)
def test_every_link_resolves(page):
    assert link_problems((ROOT / page).read_text(), page) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_path_named_in_code_exists(page):
    assert inline_path_problems((ROOT / page).read_text(), page) == []


@pytest.mark.parametrize("page", PAGES + ["cluster/README.md"])
def test_every_command_shown_parses(page):
    assert command_problems((ROOT / page).read_text(), page) == []


def test_the_readme_shows_the_commands_users_run():
    readme = (ROOT / "README.md").read_text()
    shown = [line for lang, body in fenced_blocks(readme) if lang == "bash" for line in body]
    assert any("pip install -e" in line and "diloco-ray train configs/tiny.yaml" in line for line in shown)
    assert "python -m pytest -q" in shown, ".ci/run runs the README's test command"
    assert any(line.startswith("ray job submit") for line in shown)


def interface_rows(heading: str) -> set[str]:
    """The names in the first column of the first table at or after ``heading`` in docs/interface.md."""
    text = (ROOT / "docs" / "interface.md").read_text()
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])
    return {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}


def test_the_interface_page_names_every_event_kind():
    kinds = {c.event for c in vars(events).values() if isinstance(c, type) and issubclass(c, events.Event)} - {""}
    assert kinds | {"round"} == interface_rows("| event | when | keys |")


def test_the_interface_page_names_every_round_record_key():
    fragment = records.FragmentRecord(0, 1, 1, 1, 1, 1.0, 0.1)
    merge = records.MergeFacts(staleness={}, applied_weight=1.0, in_flight=[], work=1.0, merge_seconds=0.1)
    record = records.RoundRecord(
        round=0,
        replica_ids=[0],
        dropped=[],
        late=[],
        rejected={},
        inner_steps=1,
        replica_steps={},
        tokens=1,
        train_loss=1.0,
        outer_lr=1.0,
        pseudo_grad_norm=1.0,
        data_ranges={},
        resumed_steps={},
        fragments=(fragment,),
        compute_seconds=0.1,
        wasted_steps=0,
        evaluation=records.Evaluation(),
        timing=records.Timing(1.0, 1.0),
        merge=merge,
        abandoned_steps=0,
        regions={"home": {}},
    ).to_record()
    assert set(record) - {"event"} == interface_rows("The `round` record")


# ----------------------------------------------------------------------------- it can fail

BAD_PAGE = """# A page

See [the guide](no-such-page.md), [a heading](#nowhere) and [here](#a-page), and `bench/no_such.py`.

```bash
diloco-ray train configs/tiny.yaml --set no_such_field=1
diloco-ray trian configs/tiny.yaml
diloco-ray train configs/no_such.yaml
python bench/chaos.py --no-such-flag 3
python bench/no_such.py
python -m diloco_ray.no_such_module
```

```
$ diloco-ray train configs/tiny.yaml --set outer_lr=0.5
diloco-ray: error: --set: unknown field 'outer_lr'
```
"""


def test_a_dead_link_or_command_is_found():
    links = link_problems(BAD_PAGE, "docs/bad.md")
    assert links == [
        "docs/bad.md: link to missing no-such-page.md",
        "docs/bad.md: link to #nowhere: no heading '#nowhere' there",
    ]
    assert inline_path_problems(BAD_PAGE, "docs/bad.md") == ["docs/bad.md: names missing bench/no_such.py"]
    found = command_problems(BAD_PAGE, "docs/bad.md")
    for expected in (
        "no config field 'no_such_field'",
        "invalid choice: 'trian'",
        "names missing configs/no_such.yaml",
        "unrecognized arguments: --no-such-flag 3",
        "names missing bench/no_such.py",
        "no module diloco_ray.no_such_module",
        "shown failing with",
    ):
        assert any(expected in p for p in found), (expected, found)
    assert len(found) == 8, "\n".join(found)  # the unknown field twice: its name, and the config


def test_placeholders_and_shell_are_understood():
    usage = "diloco-ray sweep CONFIG.yaml --grid FIELD=V1,V2 [--grid ...] [--set KEY=VALUE ...]  # a comment"
    assert simple_commands(usage) == [["diloco-ray", "sweep", "CONFIG.yaml", "--grid", "FIELD=V1,V2"]]
    chain = "RAY_AUTH_MODE=token ray job submit --working-dir . -- diloco-ray train configs/tiny.yaml && ray stop"
    assert simple_commands(chain)[1:] == [["diloco-ray", "train", "configs/tiny.yaml"], ["ray", "stop"]]
    assert command_problems("```bash\ndiloco-ray scale OUTPUT_DIR N\n```\n", "x.md") == []
    assert slug("Over real links: `bench/wan.py`") == "over-real-links-benchwanpy"
