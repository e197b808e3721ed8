"""`WatchConfig`: the one configuration shared by every entry point and adapter."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["WatchConfig", "ConfigError", "resolve_config"]


class ConfigError(ValueError):
    """A config file or value is wrong; the message names the field and what was received."""


class WatchConfig(BaseModel):
    """What to watch and what to do when inf/nan appears.

    Every entry point (`nanwatch.watch`, the Lightning, Accelerate and HF Trainer adapters, the CLI) takes this
    same model, a dict of its fields, or the path of a YAML/JSON file holding them.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    max_frames_to_save: int = Field(21, ge=1, description="How many frames the report shows, ending at the first inf/nan.")
    trace_batch_nums: list[int] = Field(
        default_factory=list, description="0-indexed batch numbers whose every frame is logged as it happens."
    )
    abort_after_batch_num: int | None = Field(
        None, ge=0, description="Stop the run once this 0-indexed batch has finished."
    )
    report_dir: Path | None = Field(
        None, description="Where the detecting process writes the text and JSON report before raising."
    )
    watch_eval: bool = Field(
        False, description="Also watch validation/evaluation forwards (counted apart, as eval_batch_number)."
    )
    trace_ranks: Literal["zero", "all"] | list[int] = Field(
        "zero", description='Which ranks log trace output: "zero", "all", or a list of ranks.'
    )
    capture_on_detect: bool = Field(
        False,
        description="On inf/nan, the detecting process also saves what replaying the failing forward needs (its "
        "inputs, RNG states, and the weights and buffers as it began) to report_dir/replay-rank{R}-batch{N}.pt, "
        "for `nanwatch replay`. Costs a copy of the weights at every training forward; needs report_dir.",
    )

    @field_validator("trace_batch_nums")
    @classmethod
    def _non_negative_batches(cls, value: list[int]) -> list[int]:
        negative = [n for n in value if n < 0]
        if negative:
            raise ValueError(f"batch numbers are 0-indexed and cannot be negative, got {negative}")
        return value

    @field_validator("trace_ranks")
    @classmethod
    def _non_negative_ranks(cls, value: Literal["zero", "all"] | list[int]) -> Literal["zero", "all"] | list[int]:
        if isinstance(value, list) and any(r < 0 for r in value):
            raise ValueError(f"ranks cannot be negative, got {value}")
        return value

    @field_validator("max_frames_to_save", "abort_after_batch_num", "trace_batch_nums", "trace_ranks", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any) -> Any:
        # YAML reads `true`/`yes` as a bool, which pydantic would quietly take for the number 1.
        if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(item, bool) for item in value)):
            raise ValueError(f"expected whole numbers, not booleans, got {value!r}")
        return value

    @model_validator(mode="after")
    def _capture_needs_report_dir(self) -> WatchConfig:
        if self.capture_on_detect and self.report_dir is None:
            raise ValueError("capture_on_detect=True needs report_dir: the replay file is written there")
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> WatchConfig:
        """Build a config from a mapping; unknown keys and bad values raise `ConfigError` naming the field."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of WatchConfig fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ConfigError(_describe(error, source)) from None

    @classmethod
    def from_file(cls, path: str | Path) -> WatchConfig:
        """Read a config from a `.yaml`/`.yml` or `.json` file.

        Raises:
            ConfigError: the file is missing, unreadable, not a mapping, or holds an unknown key or a bad value.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror or error}") from error
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text) if text.strip() else {}
            elif path.suffix.lower() in {".yaml", ".yml"}:
                data = yaml.safe_load(text) or {}
            else:
                raise ConfigError(f"config file {str(path)!r}: expected a .yaml, .yml or .json file")
        except (yaml.YAMLError, json.JSONDecodeError) as error:
            raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:].upper()}: {error}") from error
        return cls.from_dict(data, source=f"config file {str(path)!r}")

    def with_overrides(self, **overrides: Any) -> WatchConfig:
        """Return a copy with some fields replaced, validated like any other input."""
        if not overrides:
            return self
        return WatchConfig.from_dict({**self.model_dump(), **overrides}, source="overrides")


def _describe(error: ValidationError, source: str) -> str:
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(root)"
        if item["type"] == "extra_forbidden":
            known = ", ".join(WatchConfig.model_fields)
            near = difflib.get_close_matches(field, list(WatchConfig.model_fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            problems.append(f"unknown field {field!r} ({hint}known fields: {known})")
        else:
            problems.append(f"field {field!r}: {item['msg']} (got {item.get('input')!r})")
    return f"{source}: " + "; ".join(problems)


def resolve_config(config: WatchConfig | dict[str, Any] | str | Path | None, **overrides: Any) -> WatchConfig:
    """Turn whatever an entry point was given (a config, a dict, a file path, or nothing) into a `WatchConfig`."""
    if config is None:
        base = WatchConfig()
    elif isinstance(config, WatchConfig):
        base = config
    elif isinstance(config, dict):
        base = WatchConfig.from_dict(config)
    elif isinstance(config, (str, Path)):
        base = WatchConfig.from_file(config)
    else:
        raise ConfigError(
            f"config must be a WatchConfig, a dict, or a path to a YAML/JSON file, got {type(config).__name__}"
        )
    return base.with_overrides(**overrides)
