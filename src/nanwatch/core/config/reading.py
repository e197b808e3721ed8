"""Reading a config file: the mapping a `.yaml`/`.yml` or `.json` file holds, before any field is validated.

Apart from `WatchConfig` because files fail in their own ways (missing, not UTF-8, not YAML, a YAML alias bomb), each
told in one line naming the file; the CLI reads files through here too, without building a config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from nanwatch.core.config.messages import shorten
from nanwatch.errors import ConfigError

__all__ = ["MAX_VALUES", "read_config_file", "too_many_values"]

# A config is a handful of fields: a document of more values than this (YAML aliases can nest a small file into
# billions of them) is refused before anything walks it.
MAX_VALUES = 10_000


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a `.yaml`/`.yml` or `.json` config file holds (empty for an empty file), not yet validated.

    Raises:
        ConfigError: the file is missing or unreadable, not UTF-8 text, not YAML/JSON, not a mapping, or far too big.
    """
    path = Path(path)
    shown = repr(str(path))
    suffix = path.suffix.lower()
    if suffix not in {".json", ".yaml", ".yml"}:
        raise ConfigError(f"config file {shown}: expected a .yaml, .yml or .json file, got {suffix or 'no suffix'!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {shown}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {shown} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); "
            "expected a YAML or JSON file"
        ) from None
    try:
        data = (json.loads(text) if text.strip() else None) if suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as error:
        raise ConfigError(
            f"config file {shown} is not valid {suffix[1:].upper()}: {shorten(str(error), 300)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {shown}: expected a mapping of WatchConfig fields, got {type(data).__name__}")
    if too_many_values(data):
        raise ConfigError(
            f"config file {shown} holds more than {MAX_VALUES} values (YAML anchors and aliases nested into each "
            "other?); a config is a handful of fields"
        )
    return data


def too_many_values(data: object) -> bool:
    """Whether `data` holds more than `MAX_VALUES` values, counting shared (aliased) containers each time they
    appear, as validation would walk them; stops counting as soon as it knows."""
    budget = MAX_VALUES
    stack = [data]
    while stack:
        value = stack.pop()
        budget -= 1
        if budget < 0:
            return True
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False
