"""`WatchConfig` on the command line: options generated from the model's own fields, plus `--config FILE`.

Every `nanwatch` command that runs a model, and every example, calls `add_config_arguments(parser)` and then
`config_from_args(args)`. The options follow the fields' type hints, so a field added to `WatchConfig` appears on
every command line without touching this module:

    --max-frames-to-save 50        int
    --trace-batch-nums 1 3         list[int] (no value: the empty list)
    --abort-after-batch-num none   int | None ("none" clears a value from the file)
    --report-dir DIR               Path | None
    --watch-eval / --no-watch-eval bool
    --trace-ranks all | 0 2        "zero" | "all" | list[int]

Precedence: `WatchConfig` defaults < the command's own defaults < `--config FILE` < options given on the line.

The tools that read what a run wrote (`nanwatch show`, `diff`, `plot`, `doctor`, `replay`) take the same options, so
the config file of the training runs drives them too. Each uses a few fields; `add_config_arguments(parser,
used=...)` still accepts the others (a shared config file loads; an unused option given on the line gets a note) but
leaves them out of `--help`, `fields_epilog` says what each used field does there, and `tool_config` says which fields
were given at all, so a tool applies a field only when it was set (a file's `max_frames_to_save: 50`, not the default
21). The text-to-value checks are `nanwatch.cli.validators`, shared with the commands' own options.

Why argparse, and not a library that derives the command line from the model (tried: pydantic-settings 2.16's
`CliSettingsSource` with kebab case, implicit flags and `cli_parse_none_str="none"`; jsonargparse 4.53, which
LightningCLI uses): each changes command lines that work today.
- pydantic-settings takes a list as one token per flag (`--trace-batch-nums 149 --trace-batch-nums 150`, or
  `149,150`): `--trace-batch-nums 149 150` and `--trace-ranks 0 2` stop with "unrecognized arguments",
  `--trace-batch-nums` alone (the empty list) is refused, and `--trace-ranks all` fails validation (it reaches the
  model as `['all']`). `WatchConfig` would have to become a `BaseSettings`, which also reads environment variables.
- jsonargparse names the options `--max_frames_to_save` (no `--max-frames-to-save`), a bool takes a value
  (`--watch_eval true`, no `--no-watch-eval`), a list is JSON (`--trace_batch_nums [149,150]`), `none` is not
  None (only `null` is; `--report-dir none` is the path "none"), and its errors span several lines.
- Neither knows this module's other half (a command's own defaults between the model's and the file's, fields
  accepted but left out of `--help`, which fields the file and the line set), and each costs start-up time on
  `show`/`diff`/`plot`: importing it after pydantic and `WatchConfig` took 56 ms (pydantic-settings) and 33 ms
  (jsonargparse) here, as much as this module itself (33 ms).
"""

from __future__ import annotations

import argparse
import re
import textwrap
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from nanwatch.cli import validators
from nanwatch.core.config import ConfigError, WatchConfig, echo, read_config_file
from nanwatch.core.config.messages import unknown_field

__all__ = [
    "ConfigOption",
    "ToolConfig",
    "ToolHelpFormatter",
    "add_config_arguments",
    "config_from_args",
    "config_options",
    "fields_epilog",
    "parse_dict",
    "tool_config",
]

# Parsed values live under these attribute names, apart from the command's own options.
_DEST_PREFIX = "watch_config."
_FILE_DEST = "watch_config_file"
_DEFAULTS_DEST = "watch_config_defaults"


@dataclass(frozen=True)
class ConfigOption:
    """One generated option: the field it sets, its flag, and the keyword arguments given to `add_argument`."""

    field: str
    flag: str
    kwargs: Mapping[str, Any]


def config_options() -> list[ConfigOption]:
    """The options generated from `WatchConfig`'s fields, in field order.

    Raises:
        TypeError: a field's type hint has no command-line form (a new kind of field needs support here).
    """
    return [_option_for(name, info) for name, info in WatchConfig.model_fields.items()]


def add_config_arguments(
    parser: argparse.ArgumentParser,
    *,
    defaults: Mapping[str, Any] | WatchConfig | None = None,
    used: Collection[str] | None = None,
) -> argparse.ArgumentParser:
    """Add `--config FILE` and one option per `WatchConfig` field to `parser`, in their own argument group.

    Args:
        parser: the command's parser (or subparser).
        defaults: the command's own defaults for some fields (e.g. fewer frames for a demo); they sit between
            `WatchConfig`'s defaults and the config file, and `--help` shows them.
        used: for a command that uses only some fields (a tool reading a run's files): those fields. The others
            stay accepted, so a config file shared with training runs loads, but `--help` does not list them.

    Returns:
        The same parser, for chaining.

    Raises:
        ConfigError: `defaults` names an unknown field or holds a bad value.
        ValueError: `used` names a field `WatchConfig` does not have.
    """
    base = _as_config(defaults, source="command defaults")
    if used is not None:
        _check_fields(used)
    description = "Any WatchConfig field; precedence: defaults < --config FILE < these options."
    if used is not None:
        description = (
            "The WatchConfig fields this command uses; precedence: defaults < --config FILE < these options. The "
            "other fields are accepted and ignored, so one config file serves training runs and this command."
        )
    group = parser.add_argument_group("watch config", description)
    group.add_argument(
        "--config",
        dest=_FILE_DEST,
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML or JSON file of WatchConfig fields; unknown keys are an error",
    )
    for option in config_options():
        kwargs = dict(option.kwargs)
        shown = getattr(base, option.field)
        if used is not None and option.field not in used:
            kwargs["help"] = argparse.SUPPRESS  # accepted (a shared config's field on the line), not listed
        else:
            kwargs["help"] = f"{kwargs['help']} (default: {_show(shown).replace('%', '%%')})"
        group.add_argument(option.flag, **kwargs)
    if defaults is not None:
        parser.set_defaults(**{_DEFAULTS_DEST: base})
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> WatchConfig:
    """Build the `WatchConfig` that `add_config_arguments`' options describe.

    Args:
        args: the parsed namespace.
        parser: when given, a bad file or value ends the command through `parser.error` (usage, message, exit 2)
            instead of raising.

    Returns:
        The config: defaults, then the command's defaults, then the file, then the options given on the line.

    Raises:
        ConfigError: the file is unreadable or holds an unknown key or bad value, or an option's value is invalid
            (only when `parser` is None).
    """
    return tool_config(args, parser).config


def parse_dict(data: Mapping[str, Any], allow_extra_keys: bool = False, *, source: str = "config") -> WatchConfig:
    """Build a `WatchConfig` from a mapping, such as one section of a larger training config.

    Args:
        data: field names to values.
        allow_extra_keys: ignore keys that are not `WatchConfig` fields instead of rejecting them.
        source: how error messages name where `data` came from.

    Returns:
        The validated config.

    Raises:
        ConfigError: `data` is not a mapping, holds an unknown key (unless allowed; the message names it and the
            nearest field), or a bad value.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of WatchConfig fields, got {type(data).__name__}")
    if allow_extra_keys:
        data = {key: value for key, value in data.items() if key in WatchConfig.model_fields}
    return WatchConfig.from_dict(dict(data), source=source)


@dataclass(frozen=True)
class ToolConfig:
    """A command's config, and which fields the config file and the command line set.

    Attributes:
        config: the merged config (defaults < file < options).
        from_file: fields the `--config` file holds.
        from_line: fields given as options.
    """

    config: WatchConfig
    from_file: frozenset[str]
    from_line: frozenset[str]

    @property
    def given(self) -> frozenset[str]:
        """Fields set by the file or the line: the ones a tool applies (a default changes nothing it shows)."""
        return self.from_file | self.from_line

    def unused_options(self, used: Collection[str]) -> list[str]:
        """The options given on the line that the command does not use, as flags (`--watch-eval`), in field order."""
        return [_flag(name) for name in WatchConfig.model_fields if name in self.from_line and name not in used]


def tool_config(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> ToolConfig:
    """Like `config_from_args`, and also say which fields the file and the line set.

    Raises:
        ConfigError: as `config_from_args` (only when `parser` is None; else the command ends with exit status 2).
    """
    try:
        return _resolve(args)
    except ConfigError as error:
        if parser is None:
            raise
        parser.error(str(error))


def fields_epilog(command: str, used: Mapping[str, str]) -> str:
    """The `--help` epilog of a command that uses only some fields: what each used field does there, and the rest.

    Args:
        command: the command's name, as the text calls it.
        used: each field the command uses, to what it does in this command.

    Raises:
        ValueError: `used` names a field `WatchConfig` does not have.
    """
    _check_fields(used)
    lines = [f"WatchConfig fields used by {command} (from --config FILE or their options; unset, they change nothing):"]
    lines.extend(f"  {name}: {what}" for name, what in used.items())
    lines.append(
        f"The other WatchConfig fields are accepted and ignored by {command}, so that a config file shared with "
        "training runs loads (nanwatch config prints them all)."
    )
    return "\n".join(lines)


class ToolHelpFormatter(argparse.HelpFormatter):
    """Wraps each line of a description or epilog on its own, so a list of fields stays a list; an indented line
    keeps its indent and wraps under its own text."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        filled = []
        for line in text.splitlines():
            lead = indent + line[: len(line) - len(line.lstrip())]
            body = re.sub(r"\s+", " ", line).strip()
            filled.append(textwrap.fill(body, width, initial_indent=lead, subsequent_indent=lead + "  ") or lead)
        return "\n".join(filled)


# --------------------------------------------------------------------------------------------------------------------


def _resolve(args: argparse.Namespace) -> ToolConfig:
    namespace = vars(args)
    base: WatchConfig = namespace.get(_DEFAULTS_DEST) or WatchConfig()
    path = namespace.get(_FILE_DEST)
    from_file = read_config_file(path) if path is not None else {}
    given = {key[len(_DEST_PREFIX) :]: value for key, value in namespace.items() if key.startswith(_DEST_PREFIX)}
    # One validation of the merged values, so that a rule across fields (capture_on_detect needs report_dir) may be
    # met by the file and the line together.
    try:
        config = WatchConfig.model_validate({**base.model_dump(), **from_file, **given})
    except ValidationError as error:
        raise ConfigError(_explain(error, given, f"config file {str(path)!r}")) from None
    return ToolConfig(config, frozenset(from_file), frozenset(given))


def _check_fields(names: Collection[str]) -> None:
    unknown = sorted(set(names) - set(WatchConfig.model_fields))
    if unknown:
        raise ValueError(f"not WatchConfig fields: {', '.join(unknown)} (known: {', '.join(WatchConfig.model_fields)})")


def _explain(error: ValidationError, given: Mapping[str, Any], file_source: str) -> str:
    """Say where each bad value came from: an option on the line, the config file, or their combination."""
    problems = []
    fields = list(WatchConfig.model_fields)
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else None
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            problems.append(f"{file_source}: {unknown_field(str(field), fields)}")
        elif field is None:
            problems.append(f"the combined config (defaults, file, options): {message}")
        elif field in given:
            problems.append(f"option {_flag(field)}: {message} (got {echo(item.get('input'))})")
        else:
            problems.append(f"{file_source}: field {field!r}: {message} (got {echo(item.get('input'))})")
    return "; ".join(problems)


def _as_config(defaults: Mapping[str, Any] | WatchConfig | None, *, source: str) -> WatchConfig:
    if defaults is None:
        return WatchConfig()
    if isinstance(defaults, WatchConfig):
        return defaults
    return parse_dict(defaults, source=source)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _show(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value) if value else "none"
    return "none" if value is None else str(value)


# --------------------------------------------------------------------------------------------------------------------
# From a type hint to an argparse option: bool, a scalar (int, float, str, Path, Literal), a list of one, an optional
# one (`none` clears it), or a union of scalars and lists tried in order (`trace_ranks`: "zero" | "all" | list[int]).


def _option_for(name: str, info: FieldInfo) -> ConfigOption:
    kwargs: dict[str, Any] = {
        "dest": _DEST_PREFIX + name,
        "default": argparse.SUPPRESS,  # absent unless given, so the file's value stands
        # argparse expands %-formats in help: a description's "1%" must reach it as "1%%".
        "help": (info.description or name).rstrip(".").replace("%", "%%"),
    }
    members = list(get_args(info.annotation)) if get_origin(info.annotation) in _UNIONS else [info.annotation]
    optional = type(None) in members
    members = [m for m in members if m is not type(None)]
    only = members[0] if len(members) == 1 else None
    none = "|none" if optional else ""
    if only is bool and not optional:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif not all(_is_scalar(m) or _is_scalar_list(m) for m in members):
        raise TypeError(f"WatchConfig.{name}: no command-line form for type {info.annotation!r}; add one in {__name__}")
    elif _is_scalar_list(only):
        kwargs.update(nargs="*", type=_check(get_args(only)[0]), metavar=_metavar(get_args(only)[0]))
    elif only is not None:
        check = _check(only)
        kwargs.update(type=validators.or_none(check) if optional else check, metavar=_metavar(only) + none)
    else:
        # e.g. "zero|all|N": each token is one of the alternatives (a list takes several tokens).
        kwargs.update(
            nargs="+" if any(_is_scalar_list(m) for m in members) else None,
            action=_union_action(members, optional),
            metavar="|".join(_metavar(get_args(m)[0] if _is_scalar_list(m) else m) for m in members) + none,
        )
    return ConfigOption(name, _flag(name), kwargs)


_UNIONS = (Union, types.UnionType)


def _is_scalar(annotation: Any) -> bool:
    return annotation in (int, float, str, Path) or get_origin(annotation) is Literal


def _is_scalar_list(annotation: Any) -> bool:
    args = get_args(annotation)
    return get_origin(annotation) is list and len(args) == 1 and _is_scalar(args[0])


def _check(annotation: Any) -> Callable[[str], Any]:
    if get_origin(annotation) is Literal:
        return validators.choice(get_args(annotation))
    return validators.typed(annotation)


def _union_action(members: list[Any], optional: bool) -> type[argparse.Action]:
    """An action that tries each alternative in order, e.g. `"zero" | "all" | list[int]`."""

    def convert(tokens: list[str]) -> Any:
        if optional and len(tokens) == 1 and tokens[0].lower() in validators.NONE_WORDS:
            return None
        for member in members:
            try:
                if _is_scalar_list(member):
                    return [_check(get_args(member)[0])(token) for token in tokens]
                if len(tokens) == 1:
                    return _check(member)(tokens[0])
            except argparse.ArgumentTypeError:
                continue
        wanted = " or ".join(_describe(m) for m in members)
        raise ValueError(f"expected {wanted}, got {' '.join(tokens)!r}")

    class UnionAction(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: str | Any | None,
            option_string: str | None = None,
        ) -> None:
            tokens = [values] if isinstance(values, str) else list(values or [])
            try:
                setattr(namespace, self.dest, convert(tokens))
            except ValueError as error:
                raise argparse.ArgumentError(self, str(error)) from None

    return UnionAction


def _describe(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(annotation))
    if get_origin(annotation) is list:
        return f"a list of {validators.noun(get_args(annotation)[0], plural=True)}"
    return validators.noun(annotation)


def _metavar(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "|".join(str(c) for c in get_args(annotation))
    return validators.metavar(annotation)
