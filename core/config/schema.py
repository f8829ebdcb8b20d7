"""How a run setting is declared, once, on its `RunConfig` field: default, type, title, description, bounds, choices
and format (`setting()`), and what reads those declarations.

`RunConfig` and its sections (`core/config/__init__.py`, `sections.py`) declare every setting as a field:
`num_workers: int = setting(2, "Workers", "...", minimum=1, maximum=64)`. The field gives the name, the section and
the type; `declared(RunConfig)` lists them all as `Setting` records, in the trigger form's order. Their readers:
- the DAG declares one Airflow `Param` per setting from `param_kwargs(setting)` (the trigger form, `--conf`);
- `RunConfig` checks each field's type with pydantic against its annotation (`core.config.core.checked_value`),
  its bounds (`bounds`), choices (`choices`) and patterns, and the rules between settings that no JSON schema says;
- docs/settings.md's table is written from them (`core.config.table`), and a test keeps it so.

The Params are flat (`{"num_workers": 4}`); `section` says where each setting lives in the nested `RunConfig`
("" for the core training settings, `launch`, `launch.ssh`, `launch.kubernetes`, `promotion`, `monitoring`). A
setting keeps its one name everywhere: in the form, in `--conf`, in the saved config and in every error message.

Stdlib only: the settings' declarations and formats, which the rest of `core.config` builds on.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SECTIONS = ("", "launch", "launch.ssh", "launch.kubernetes", "promotion", "monitoring")

MODEL_PRESET_NAMES = ("tiny", "gpt2-124m", "tiny-llama")
EXPORT_FORMATS = ("safetensors", "saved_model")
DEFAULT_TRAINER_IMAGE = "gpt-finetune-trainer:2.21.0"  # docker/trainer.Dockerfile
# Single-value formats, as Python `re` patterns matched whole (`fullmatch`); the Params anchor them.
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"  # one path segment, safe in local paths and S3 keys
REVISION = r"[A-Za-z0-9._/-]{1,255}"
QUEUE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}"  # as `airflow celery worker -q` takes it (a comma splits it)
CONN_ID = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}"  # an Airflow connection id (no leading '-' or '.')
# A plain address: no comment, quoting, source route (`%`, `!`, `@a:`) or address literal that a mail server reads
# another way than the domain check does.
EMAIL = r"[A-Za-z0-9._+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+"
IMAGE = r"[A-Za-z0-9][A-Za-z0-9._/:@-]*"
CPU_QUANTITY = r"\d+(\.\d+)?m?"
MEMORY_QUANTITY = r"\d+(\.\d+)?([KMGTPE]i?|k)?"
ABSOLUTE_PATH = r"/.*"
TEXT_COLUMN = r"[A-Za-z0-9_][A-Za-z0-9_. -]{0,127}"  # a column or field name: nothing Markdown or HTML reads
LORA_TARGET = r"[A-Za-z_][A-Za-z0-9_]{0,63}"  # a module name as PEFT's target_modules matches it
# Longest values of free-form strings (the form, --conf and RunConfig refuse longer ones).
MAX_LOCATION = 4096  # a path or URL (Linux's PATH_MAX)
MAX_NAME = 253  # a connection id, service account, address or image reference
MAX_GRAD_ACCUM = 1024
CAPACITIES = ("on_demand", "reserved", "spot")  # the rates of the operator's pricing table


@dataclass(frozen=True)
class Setting:
    """One run setting, as its declaration (`setting()`) on a `RunConfig` field says.

    Attributes:
        name: the field's name: the key in the Params, `--conf`, the saved config and every error message.
        section: where `RunConfig` holds it (`SECTIONS`; "" is the top level).
        default: the value when the trigger does not give one (the DAG may override a few from its environment).
        type: its JSON type (integer, number, string, boolean, array or object), from the field's annotation.
        title: the trigger form's label.
        description: the trigger form's help text, and the meaning in docs/settings.md.
        optional: the form may send null (a cleared field): read as empty, or as unset for `min_workers`.
        rules: the JSON-schema keywords of its bounds, choices and format (minimum, maximum, exclusiveMinimum,
            enum, pattern, minLength, maxLength, items, uniqueItems, additionalProperties).
        allowed: docs/settings.md's "allowed" column where the rules alone do not say it (a rule between settings).
        see: the docs section that explains it, as a Markdown link (docs/settings.md's meaning ends with it).
    """

    name: str
    section: str
    default: Any
    type: str
    title: str
    description: str = ""
    optional: bool = False
    rules: Mapping[str, Any] = field(default_factory=dict)
    allowed: str = ""
    see: str = ""

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"setting {self.name}: unknown section {self.section!r}, expected one of {SECTIONS}")
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))


def setting(default: Any, title: str, description: str = "", *, optional: bool = False, pattern: str | None = None,
            allowed: str = "", see: str = "", **rules: Any) -> Any:
    """Declare a run setting as a `RunConfig` field: `num_workers: int = setting(2, "Workers", "...", minimum=1)`.

    The field gives the name, the section and the type; this gives the rest (see `Setting`). `rules` are JSON-schema
    keywords; `pattern` is a Python `re` pattern matched whole (anchored here for the Params, which search)."""
    if pattern is not None:  # an optional field may be empty
        rules["pattern"] = f"^({pattern})?$" if optional else f"^({pattern})$"
    declared = {_DECLARED: {"title": title, "description": description, "optional": optional, "rules": rules,
                            "allowed": allowed, "see": see}}
    if isinstance(default, Mapping):
        return field(default_factory=lambda: MappingProxyType(dict(default)), metadata=declared)
    return field(default=default, metadata=declared)


_DECLARED = "setting"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", tuple: "array", Mapping: "object"}


def _json_type(annotation: Any) -> str:
    arms = [arm for arm in typing.get_args(annotation) if arm is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(arms) == 1:
        return _json_type(arms[0])  # X | None: the form's null is the optional flag
    return _JSON_TYPES[typing.get_origin(annotation) or annotation]


@functools.cache
def declared(config_type: type) -> tuple[Setting, ...]:
    """The settings a config class (`RunConfig`) declares, its own fields first, then each section's, in order."""
    return tuple(_walk(config_type, ""))


def _walk(holder: type, section: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(holder)
    for spec in dataclasses.fields(holder):
        if _DECLARED in spec.metadata:
            default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            yield Setting(spec.name, section, default, _json_type(hints[spec.name]), **spec.metadata[_DECLARED])
        elif dataclasses.is_dataclass(hints[spec.name]):
            yield from _walk(hints[spec.name], f"{section}.{spec.name}" if section else spec.name)


def choices(config_type: type, name: str) -> tuple[Any, ...]:
    """The values the setting `name` of a config class (or each item of a list setting) may take."""
    rules = by_name(config_type)[name].rules
    return tuple(rules["enum"] if "enum" in rules else rules["items"]["enum"])


def bounds(settings: tuple[Setting, ...], low: str) -> dict[str, tuple[float, float]]:
    """The bounds RunConfig applies, by setting: (`low`, maximum), where `low` is "minimum" (inclusive) or
    "exclusiveMinimum". An optional setting's (`min_workers`) is RunConfig's own rule."""
    return {s.name: _bounds(s, low) for s in settings if low in s.rules and not s.optional}


def _bounds(setting: Setting, low: str) -> tuple[float, float]:
    kind = float if setting.type == "number" else int
    return kind(setting.rules[low]), kind(setting.rules["maximum"])


@functools.cache
def by_name(config_type: type) -> Mapping[str, Setting]:
    return MappingProxyType({setting.name: setting for setting in declared(config_type)})


def value_of(config: Any, name: str) -> Any:
    """Setting `name` of a `RunConfig`, found in its section."""
    holder = config
    for part in filter(None, by_name(type(config))[name].section.split(".")):
        holder = getattr(holder, part)
    return getattr(holder, name)


def flat_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config's settings by name: nested by section (`RunConfig.to_dict()`) or flat (the Params' shape, as
    configs saved before the sections are). Nothing is checked here: `RunConfig.from_saved` does, and a reader of an
    earlier run's report reads what it finds."""
    flat: dict[str, Any] = {}

    def walk(mapping: Mapping[str, Any], path: str) -> None:
        for key, value in mapping.items():
            section = f"{path}.{key}" if path else key
            if section in SECTIONS and isinstance(value, Mapping):
                walk(value, section)
            else:
                flat[key] = value

    walk(saved, "")
    return flat


def thawed(value: Any) -> Any:
    """The JSON shape of a frozen value: dicts and lists."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thawed(item) for item in value]
    return value


def param_kwargs(setting: Setting, default_value: Any = None) -> dict[str, Any]:
    """The keyword arguments of the setting's Airflow `Param`: `default` first, then its JSON schema. An optional
    setting's type admits null: the trigger form refuses to submit an empty required field."""
    value = setting.default if default_value is None else default_value
    return {"default": thawed(value), "type": ["null", setting.type] if setting.optional else setting.type,
            "title": setting.title, **({"description": setting.description} if setting.description else {}),
            **setting.rules}
