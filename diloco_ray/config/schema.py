"""TrainerConfig: a diloco-ray job's settings, validated on construction, loaded from YAML
with ``--set KEY=VALUE`` overrides, and written back as the resolved ``config.yaml``.

The fields themselves (names, types, defaults, one-line meanings, ranges) are the table in
:mod:`diloco_ray.config.fields`; their rules are :mod:`diloco_ray.config.validation`; the
typed sections each part of the job receives are :mod:`diloco_ray.config.sections`. Every
error raised here is a :class:`ConfigError` whose message names the field, the value and
what is allowed, so the CLI can print it as one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from diloco_ray import files
from diloco_ray.config.fields import CODEC_FIELDS, FIELD_NAMES, FIELDS, ConfigFields, codec_defaults, field_help
from diloco_ray.config.sections import Sections
from diloco_ray.config.validation import validate
from diloco_ray.errors import ConfigError

__all__ = ["FIELDS", "FIELD_NAMES", "TrainerConfig", "apply_override", "field_help", "parse_set", "read_config_file"]


@dataclass
class TrainerConfig(ConfigFields):
    """Every setting of a DiLoCo job, validated. Build with keywords, :meth:`from_yaml` or
    :meth:`from_dict`; the fields and their meanings are :class:`~diloco_ray.config.fields.ConfigFields`.

    Args:
        **fields: field name -> value; a value out of its type or range, or fields that
            contradict each other, raise a ConfigError naming the field.
    """

    def __post_init__(self) -> None:
        # The fields a codec brings defaults for are resolved here, once, so config.yaml
        # holds the values the run used and a resumed run uses them again.
        for name, value in codec_defaults({name: getattr(self, name) for name in CODEC_FIELDS}).items():
            setattr(self, name, value)
        validate(self)

    def __setattr__(self, name: str, value: Any) -> None:
        # A field set after construction drops the sections built from the old values.
        super().__setattr__(name, value)
        self.__dict__.pop("_sections", None)

    def sections(self) -> Sections:
        """The typed sections of this config (:class:`~diloco_ray.config.sections.Sections`),
        built once from the validated values and rebuilt only after a field changes."""
        built = self.__dict__.get("_sections")
        if built is None:
            built = Sections.of(self)
            self.__dict__["_sections"] = built
        return built

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "TrainerConfig":
        """Build from a plain dict; unknown keys name the closest valid field.

        Args:
            values: field name -> value.
            source: what to call the input in error messages (a file name, say).
        """
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of field: value, got {type(values).__name__}")
        for key in values:
            if key not in FIELD_NAMES:
                raise ConfigError(f"{source}: unknown field '{key}'{_closest(key)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[dict] = None) -> "TrainerConfig":
        """Load a YAML file and apply overrides (dotted keys reach into dict fields).

        Args:
            path: the YAML file.
            overrides: field -> value applied on top, e.g. ``{"output_dir": "out"}`` or
                ``{"outer_opt_kwargs.nesterov": False}``.
        """
        return cls.from_dict(read_values(path, overrides), source=f"config file '{path}'")

    def to_dict(self) -> dict:
        """field name -> value, every field (a deep copy)."""
        return dataclasses.asdict(self)

    def yaml_text(self, redact: bool = True) -> str:
        """The resolved config (every field, defaults included) as YAML that
        :meth:`from_yaml` reads back to an equal config, secrets aside: with ``redact``
        (the default) the value of every secret-looking key inside a mapping field (a
        ``token`` in ``dataset_kwargs``, ``storage_options``' ``key`` and ``secret``, ...) is
        ``***`` (see :func:`redacted`), so config.yaml, ``--print-config`` and the trackers'
        run config never hold one in clear."""
        values = self.to_dict()
        return yaml.safe_dump(redacted(values) if redact else values, sort_keys=False)

    def to_yaml(self, path: str, redact: bool = True) -> None:
        """Write :meth:`yaml_text` to ``path`` atomically (``redact=False``: a file another
        process runs from, written owner-only). A link at ``path`` is replaced, not followed;
        a failed write (a full disk) leaves no temp file and names ``path``."""
        with files.replacing(path, mode=None if redact else 0o600) as f:
            f.write(self.yaml_text(redact).encode("utf-8"))

    def for_replica(self, replica_id: int) -> "TrainerConfig":
        """The job as replica ``replica_id``'s ranks see it: ``ranks_per_replica`` is theirs."""
        if not isinstance(self.ranks_per_replica, list):
            return self
        return TrainerConfig.from_dict({**self.to_dict(), "ranks_per_replica": self.ranks_of(replica_id)})


_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}


def read_config_file(path: str) -> dict:
    """The mapping of field: value in the YAML file ``path``; a ConfigError naming the
    file says what is wrong with it (missing, a folder, unreadable, not YAML, empty, not
    a mapping) and what is expected."""
    expected = "expected a YAML file of field: value lines (e.g. configs/tiny.yaml)"
    if os.path.isdir(path):
        raise ConfigError(f"config file '{path}' is a folder; {expected}")
    if not os.path.exists(path):
        raise ConfigError(f"config file '{path}' does not exist; {expected}")
    try:
        with open(path, "rb") as f:  # bytes: YAML finds the encoding, and a bad byte is a YAMLError
            values = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read ({e.strerror or e}); {expected}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML ({_yaml_problem(e)}); {expected}") from None
    if values is None:
        raise ConfigError(f"config file '{path}' is empty; {expected}")
    if not isinstance(values, dict):
        kind = _KINDS.get(type(values), type(values).__name__)
        raise ConfigError(f"config file '{path}' holds {kind}, not a mapping of field: value; {expected}")
    return values


def _yaml_problem(e: "yaml.YAMLError") -> str:
    """Where and what, in one line: ``line 2, column 1: expected ',' or ']'``."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if getattr(e, "position", None) is not None:  # a ReaderError: a byte that is not text
        return f"byte {e.position}: {problem}"
    return problem


# Keys whose values are secrets, wherever they sit inside a mapping field (dataset_kwargs,
# storage_options inside it, ...): hub tokens, cloud keys, passwords. Whole words between
# underscores, so that ``max_tokens`` and ``num_key_value_heads`` are not.
SECRET_KEY = re.compile(
    r"(^|_)(token|secrets?|password|passwd|credentials?|auth|api_?key|access_?key|secret_?key|private_?key)($|_)"
    r"|^keys?$",  # a bare key (storage_options' "key"), not num_key_value_heads
    re.IGNORECASE,
)
REDACTED = "***"


def redacted(values: dict) -> dict:
    """A config's field values with the value of every secret-looking key inside a mapping
    field, at any depth, replaced by ``***`` (empty values are left: nothing to hide).
    Field names themselves are never secrets (``tokenizer_name`` stays)."""
    return {k: _redact_inside(v) for k, v in values.items()}


def without_secrets(values: dict) -> dict:
    """A config's field values with every secret-looking key inside a mapping field taken
    out (the keys :func:`redacted` masks): what the home hands another region, which reads
    its own secrets from its own environment (``HF_TOKEN``, ``AWS_*``, ``WANDB_API_KEY``)."""
    return {k: _drop_inside(v) for k, v in values.items()}


def _drop_inside(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_inside(v) for k, v in value.items() if not (isinstance(k, str) and SECRET_KEY.search(k))}
    if isinstance(value, list):
        return [_drop_inside(v) for v in value]
    return value


def _redact_inside(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and SECRET_KEY.search(k) and v not in (None, "") else _redact_inside(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact_inside(v) for v in value]
    return value


def read_values(path: str, overrides: Optional[dict] = None) -> dict:
    """A config file's field values with ``overrides`` applied, not yet validated (a sweep
    lays each trial's values over them before its config is built)."""
    values = read_config_file(path)
    for key, value in (overrides or {}).items():
        apply_override(values, key, value)
    return values


def parse_set(items: list[str]) -> dict:
    """Parse ``KEY=VALUE`` strings; values are YAML scalars, lists or maps."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got '{item}'")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: '{raw}' is not a valid YAML value") from None
    return out


def apply_override(values: dict, key: str, value: Any) -> None:
    """Set ``values[key] = value``; ``a.b`` sets key ``b`` inside dict field ``a``."""
    head, _, rest = key.partition(".")
    if head not in FIELDS:
        raise ConfigError(f"--set: unknown field '{head}'{_closest(head)}")
    if not rest:
        values[head] = value
        return
    inner = values.get(head)
    if inner is None:
        inner = {}
    if not isinstance(inner, dict):
        raise ConfigError(f"--set {key}: field '{head}' is not a mapping")
    inner = dict(inner)
    inner[rest] = value
    values[head] = inner


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, FIELD_NAMES, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else " (see `diloco-ray train --help` for the fields)"
