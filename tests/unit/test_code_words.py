"""Comments and docstrings in ``diloco_ray/`` say what the code does and why, in words.

A date, a commit id, a measured figure or the before-and-after of a change goes stale the day
the code moves on, and it belongs to a commit message or to BENCHMARKS.md, where it keeps its
context. This test reads every comment (by tokenizing) and every module, class and function
docstring of the package and lists each hit as ``file:line: text``. The rules for a measured
figure are heuristics, tuned to pass constants that a sentence explains ("the default 2048
values per scale", "fp32 is 4 bytes") and to catch what a run printed ("took 1.1 s", "2.5x
faster", "median 0.772"); the self-tests below show one of each.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "diloco_ray"

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Hex of 7 to 40 digits holding both a digit and a letter: how git abbreviates a commit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")

NUM = r"\d+(?:\.\d+)?"
DEC = r"\d+\.\d+"
# A figure given as a range ("8-12", "3.7-5.5") is a spread of measurements.
RANGE = rf"{NUM}\s*(?:-|–|to)\s*{NUM}"
TIME = r"(?:ns|µs|us|ms|s|secs?|seconds?|min|mins|minutes?|hours?)"
SIZE = r"(?:bytes?|B|kB|KB|KiB|MB|MiB|GB|GiB|TB|TiB)"
# Throughput is only ever measured: any number in these units is a figure.
SPEED = r"(?:tokens/s|tok/s|samples/s|steps/s|it/s|params/s|rows/s|ns/param|ns per param(?:eter)?|us/param|ms/param)"
BANDWIDTH = r"(?:[kKMG]bit/s|[kKMG]bps|[kKMG]i?B/s)"
APPROX = r"(?:~|about |around |roughly |nearly |almost |some )"
# A decimal time is a measurement unless a word before it makes it a setting ("every 0.5 s").
SETTING_WORDS = "every each after wait waits sleep sleeps timeout within to than least most"
CHOSEN = "".join(f"(?<!{word} )" for word in SETTING_WORDS.split())
COST = r"(?:takes?|took|taking|costs?|costing|spent|spends?|lasts?|lasted|ran|runs? in|finish(?:es|ed)? in)"

RULES: dict[str, re.Pattern] = {
    # "measured on a 41M model", "Measured: a trial stopped after round 1 of 3 ...", "on this
    # VM": where and how a figure was taken ("the pace measured over 3 periods" is code).
    "measured": re.compile(
        r"\b(?:[Mm]easured|[Bb]enchmarked|[Pp]rofiled|[Tt]imed)(?::|\s+(?:on|at|here|with|against|as)\b)[^.;]{0,80}?\d"
        r"|\bon (?:this|the development|the dev|my|our) (?:VM|machine|box|laptop|host)\b"
    ),
    "measures at": re.compile(r"\b[Mm]easures?\b[^.;]{0,40}?\bat\s+~?\d"),
    # "(~1.1 s here)", "takes ~1 s", "costs a rank 0.2 s", "8-12 ms": a time as a run saw it.
    "time": re.compile(
        rf"(?:{APPROX}{NUM}|{RANGE}|\b{COST}\b(?:\s+\S+){{0,3}}?\s+~?{NUM})\s*{TIME}\b"
        rf"|{CHOSEN}\b{DEC}\s*{TIME}\b"
    ),
    "speed": re.compile(rf"{NUM}\s*{SPEED}"),
    "bandwidth": re.compile(rf"(?:{APPROX}{NUM}|{DEC}|{RANGE})\s*{BANDWIDTH}"),
    # "0.37 GB", "4.00 B/param": a decimal size was read off a process, not chosen.
    "size": re.compile(rf"\b{DEC}\s*{SIZE}(?:/param)?\b"),
    "percent": re.compile(rf"(?:{APPROX}{NUM}|\b{DEC}|{RANGE})\s*%"),
    # "2.5x faster", "0.81x the model": a ratio of two runs.
    "ratio": re.compile(
        rf"\b{DEC}\s*x\b|\b\d+\s*x\s+(?:faster|slower|quicker|longer|shorter|fewer|more|less|larger|smaller|bigger)\b"
        rf"\s+(?:on|than|here|in|with|at|for)\b"
    ),
    # "median 0.772", "eval loss 0.75", "0.93 vs 0.79": statistics of runs and their comparison.
    "statistic": re.compile(
        r"\bnats\b|\b(?:median|mean|average|p50|p90|p99|MFU|goodput|loss)\b\s*\(?(?:of\s+|at\s+|=\s*)?~?"
        rf"(?![01]\.0+\b){DEC}\b|\b{DEC}\s*(?:vs\.?|versus|against)\s*{DEC}\b"
    ),
    # "(was 3)", "before: 12", "down from 40": the history of a value.
    "history": re.compile(
        rf"\((?:was|were|previously|formerly)\s+~?{NUM}|\b[Bb]efore:\s*~?{NUM}|\b(?:down|up) from\s+~?{NUM}"
    ),
}


def passages(source: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of each comment block (consecutive lines holding only a comment
    are joined, so a sentence split over lines is read whole; a comment after code stands
    alone) and of each module, class and function docstring of ``source``."""
    found, block, last = [], [], -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        alone = token.line.lstrip().startswith("#")
        if (line != last + 1 or not alone) and block:
            found.append((block[0][0], "\n".join(text for _, text in block)))
            block = []
        block.append((line, token.string.lstrip("#").strip()))
        last = line if alone else -2
    if block:
        found.append((block[0][0], "\n".join(text for _, text in block)))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc:
            found.append((node.body[0].lineno, doc))
    return found


def hits(text: str) -> list[tuple[int, str, str]]:
    """``(offset, rule, matched text)`` of every date, commit id and measured figure in ``text``."""
    rules = {"date": DATE, "commit id": COMMIT, **RULES}
    return [(m.start(), rule, m.group(0)) for rule, pattern in rules.items() for m in pattern.finditer(text)]


def scan(path: pathlib.Path) -> list[str]:
    """One ``file:line: [rules] text`` entry per line of ``path``'s comments and docstrings
    that holds a hit."""
    rel = path.relative_to(PACKAGE.parent)
    found: dict[int, tuple[set[str], str]] = {}
    for first, text in passages(path.read_text()):
        lines = text.splitlines() or [""]
        for offset, rule, _ in hits(text):
            index = text.count("\n", 0, offset)
            found.setdefault(first + index, (set(), lines[index].strip()))[0].add(rule)
    return [f"{rel}:{line}: [{', '.join(sorted(rules))}] {text}" for line, (rules, text) in sorted(found.items())]


def test_comments_and_docstrings_hold_no_date_commit_or_measurement():
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in scan(path)]
    assert not found, (
        "Comments and docstrings say what and why in words; measurements, dates, commit ids and "
        "the history of a decision go to the commit message or BENCHMARKS.md:\n" + "\n".join(found)
    )


# Each rule with a sentence it catches, and sentences it must let through.
CAUGHT = {
    "date": "Re-measured on 2026-11-25 at load 7.",
    "commit id": "The per-module seed (0137b71) drew each tensor from its own seed.",
    "measured": "Unchanged at 1 MiB, measured on a 41M model; 0.13 of a sync on this VM.",
    "measures at": "The pack measures at 37 ns per value on this machine.",
    "time": "Importing PEFT costs a rank 0.2 s; the sum faults in 0.13 s of a 0.45 s sync.",
    "speed": "A rank trains at 27506 tokens/s.",
    "bandwidth": "Ray moved the message at ~800 MB/s.",
    "size": "A rank grew by 0.37 GB when loading.",
    "percent": "The codec's scales add ~0.2% to the payload.",
    "ratio": "In place it is 2.5x faster on CPU.",
    "statistic": "Both end at the same median (0.772 and 0.766) over twenty seeds; eval 0.93 vs 0.79.",
    "history": "Ten rounds between checkpoints (was 5).",
}

PASSED = [
    "The default 2048 values per scale keep the scales small next to the payload.",
    "fp32 is 4 bytes a value and bf16 is 16 bits, so a bf16 message is half the size.",
    "AdamW keeps two fp32 moments: 8 bytes per parameter of the rank's share.",
    "A manifest line is about 100 bytes, so 10,000 ranks make under 2 MiB.",
    "The threshold starts at 128 KiB and rises after the first large free, up to 32 MiB.",
    "Poll for new round records every 0.5 s, and give up after 30 seconds.",
    "At 0.828 bits per value with 1/16 kept and block 2048, headers not counted.",
    "A replica at 2x slower exactly runs half a period.",
    "Labels are -100 where no loss is taken; the loss of a round is its mean over tokens.",
    "GPT-2 draws its output projections with std 0.02 / sqrt(2 x layers).",
    "The learning rate warms up over 1000 steps to 3e-4.",
    "Staleness-aware async SGD (Zhang et al. 2016) divides the step by the staleness.",
    "The sha256 of the file, read in 1 MiB chunks; a 64-digit hash.",
    "Rounds are 0-based in the record and shown 1-based: round 3/10 is round 2.",
    "Durations print as 45s, 12m05s or 3h02m.",
    "The replica's pace, measured over its last 3 periods, sets its budget.",
    "Weights are drawn from a normal with mean 0.0 and std 0.02.",
]


@pytest.mark.parametrize("rule", sorted(CAUGHT))
def test_each_rule_catches_its_example(rule):
    assert rule in {found for _, found, _ in hits(CAUGHT[rule])}


@pytest.mark.parametrize("sentence", PASSED)
def test_constants_explained_in_words_pass(sentence):
    assert hits(sentence) == []


def test_a_comment_split_over_lines_is_read_whole():
    source = '"""A module."""\n\n# importing PEFT costs\n# a rank 0.2 s\nX = 1  # fine\n'
    texts = passages(source)
    assert (3, "importing PEFT costs\na rank 0.2 s") in texts
    assert [rule for _, rule, _ in hits("importing PEFT costs\na rank 0.2 s")] == ["time"]
