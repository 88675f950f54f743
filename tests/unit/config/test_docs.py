"""The README's config table is the one the config renders (run python -m diloco_ray.config.docs)."""

import os

from diloco_ray.config.docs import fields_table, render_readme
from diloco_ray.config.schema import FIELD_NAMES

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def test_readme_table_is_up_to_date():
    with open(README) as f:
        text = f.read()
    assert render_readme(text) == text, "README config table is stale: run `python -m diloco_ray.config.docs`"


def test_table_has_every_field_once():
    table = fields_table()
    for name in FIELD_NAMES:
        assert table.count(f"| `{name}` |") == 1
