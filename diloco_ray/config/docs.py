"""The README's config table, generated from the field table (:mod:`diloco_ray.config.fields`)
so it never drifts.

``python -m diloco_ray.config.docs`` rewrites the table between the markers in README.md;
a unit test fails when the committed README differs from what this renders.
"""

from __future__ import annotations

import sys

from diloco_ray.config.fields import field_help

START, END = "<!-- fields:start -->", "<!-- fields:end -->"


def fields_table() -> str:
    """A markdown table: field | default | meaning."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for name, default, help in field_help():
        shown = "null" if default is None else repr(default).replace("|", "\\|")
        rows.append(f"| `{name}` | `{shown}` | {help.replace('|', '/')} |")
    return "\n".join(rows)


def render_readme(text: str) -> str:
    """``text`` with the table between the markers replaced by :func:`fields_table`."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"README has no {START} ... {END} markers")
    return f"{head}{START}\n{fields_table()}\n{END}{tail}"


def main(path: str = "README.md") -> int:
    with open(path) as f:
        text = f.read()
    new = render_readme(text)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
        print(f"updated the config table in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
