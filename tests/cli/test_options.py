"""`WatchConfig` on the command line: generated options, `--config FILE`, precedence, and clear errors."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

import pytest

from nanwatch.cli.options import add_config_arguments, config_from_args, config_options, parse_dict
from nanwatch.core.config import ConfigError, WatchConfig


def _parser(**kwargs: typing.Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanwatch-test")
    parser.add_argument("--steps", type=int, default=3)  # the command's own option lives beside the generated ones
    return add_config_arguments(parser, **kwargs)


def _config(argv: list[str], **kwargs: typing.Any) -> WatchConfig:
    return config_from_args(_parser(**kwargs).parse_args(argv))


def test_every_field_gets_an_option_named_after_it() -> None:
    flags = {option.flag: option.field for option in config_options()}
    assert flags == {"--" + name.replace("_", "-"): name for name in WatchConfig.model_fields}
    parser = _parser()
    help_text = parser.format_help()
    for name, info in WatchConfig.model_fields.items():
        assert "--" + name.replace("_", "-") in help_text
        assert info.description is not None
        assert " ".join(info.description.split()[:4]) in " ".join(help_text.split())
    bools = [name for name, info in WatchConfig.model_fields.items() if info.annotation is bool]
    assert bools  # watch_eval at least
    for name in bools:
        assert "--no-" + name.replace("_", "-") in help_text


def test_nothing_given_is_the_default_config() -> None:
    assert _config([]) == WatchConfig()


def test_options_follow_the_type_hints(tmp_path: Path) -> None:
    config = _config(
        [
            "--max-frames-to-save", "50",
            "--trace-batch-nums", "1", "3",
            "--abort-after-batch-num", "7",
            "--report-dir", str(tmp_path),
            "--watch-eval",
            "--trace-ranks", "0", "2",
        ]
    )  # fmt: skip
    assert config.max_frames_to_save == 50
    assert config.trace_batch_nums == [1, 3]
    assert config.abort_after_batch_num == 7
    assert config.report_dir == tmp_path
    assert config.watch_eval is True
    assert config.trace_ranks == [0, 2]
    assert _config(["--trace-ranks", "all"]).trace_ranks == "all"
    assert _config(["--trace-ranks", "zero"]).trace_ranks == "zero"


def test_the_commands_own_options_are_untouched() -> None:
    args = _parser().parse_args(["--steps", "9", "--max-frames-to-save", "4"])
    assert args.steps == 9
    assert config_from_args(args).max_frames_to_save == 4


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_precedence_defaults_then_file_then_command_line(tmp_path: Path) -> None:
    config_file = _write(tmp_path / "watch.yaml", "max_frames_to_save: 30\ntrace_batch_nums: [2]\nwatch_eval: true\n")
    from_file = _config(["--config", str(config_file)])
    assert (from_file.max_frames_to_save, from_file.trace_batch_nums, from_file.watch_eval) == (30, [2], True)
    assert from_file.trace_ranks == "zero"  # not in the file: the default stands

    overridden = _config(["--config", str(config_file), "--max-frames-to-save", "50", "--no-watch-eval"])
    assert (overridden.max_frames_to_save, overridden.trace_batch_nums, overridden.watch_eval) == (50, [2], False)

    # The order on the line does not matter: an option beats the file either way.
    assert _config(["--max-frames-to-save", "50", "--config", str(config_file)]).max_frames_to_save == 50


def test_command_defaults_sit_between_watchconfig_defaults_and_the_file(tmp_path: Path) -> None:
    assert _config([], defaults={"max_frames_to_save": 8}).max_frames_to_save == 8
    assert "(default: 8)" in _parser(defaults={"max_frames_to_save": 8}).format_help()
    config_file = _write(tmp_path / "watch.json", json.dumps({"max_frames_to_save": 30}))
    assert _config(["--config", str(config_file)], defaults={"max_frames_to_save": 8}).max_frames_to_save == 30
    with pytest.raises(ConfigError, match="unknown field 'max_frame'"):
        _parser(defaults={"max_frame": 8})


def test_an_option_can_clear_or_empty_what_the_file_set(tmp_path: Path) -> None:
    config_file = _write(
        tmp_path / "watch.yml", f"abort_after_batch_num: 5\ntrace_batch_nums: [1, 2]\nreport_dir: {tmp_path}\n"
    )
    config = _config(["--config", str(config_file), "--abort-after-batch-num", "none", "--trace-batch-nums"])
    assert config.abort_after_batch_num is None
    assert config.trace_batch_nums == []
    assert config.report_dir == tmp_path


def test_a_typo_in_the_config_file_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = _write(tmp_path / "watch.yaml", "max_frame_to_save: 5\n")
    args = _parser().parse_args(["--config", str(config_file)])
    with pytest.raises(ConfigError) as error:
        config_from_args(args)
    message = str(error.value)
    assert f"config file {str(config_file)!r}" in message
    assert "unknown field 'max_frame_to_save' (did you mean 'max_frames_to_save'?" in message

    # Through the parser, the command ends with usage and the same message, exit status 2.
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(args, _parser())
    assert exit_info.value.code == 2
    assert "unknown field 'max_frame_to_save'" in capsys.readouterr().err


def test_bad_values_in_the_file_name_the_field(tmp_path: Path) -> None:
    config_file = _write(tmp_path / "watch.yaml", "max_frames_to_save: 0\n")
    with pytest.raises(ConfigError, match=r"field 'max_frames_to_save': Input should be greater than or equal to 1"):
        _config(["--config", str(config_file)])
    not_a_mapping = _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of WatchConfig fields, got list"):
        _config(["--config", str(not_a_mapping)])
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        _config(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match=r"expected a \.yaml, \.yml or \.json file"):
        _config(["--config", str(_write(tmp_path / "watch.toml", "x = 1\n"))])


def test_bad_values_on_the_line_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"option --max-frames-to-save: Input should be greater than or equal to 1"):
        _config(["--max-frames-to-save", "0"])
    for argv, expected in [
        (["--max-frames-to-save", "many"], "argument --max-frames-to-save: expected an integer, got 'many'"),
        (["--trace-batch-nums", "1", "x"], "argument --trace-batch-nums: expected an integer, got 'x'"),
        (["--trace-ranks", "zero", "1"], "argument --trace-ranks: expected one of 'zero', 'all' or a list of integers"),
        (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    ]:
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
        assert expected in capsys.readouterr().err


def test_a_rule_across_fields_is_reported_for_the_combined_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"combined config \(defaults, file, options\): capture_on_detect=True needs"):
        _config(["--capture-on-detect"])
    assert _config(["--capture-on-detect", "--report-dir", str(tmp_path)]).capture_on_detect
    # The file and the line may meet the rule together.
    config_file = _write(tmp_path / "capture.yaml", "capture_on_detect: true\n")
    config = _config(["--config", str(config_file), "--report-dir", str(tmp_path)])
    assert (config.capture_on_detect, config.report_dir) == (True, tmp_path)


def test_parse_dict_rejects_unknown_keys_unless_allowed() -> None:
    data = {"max_frames_to_save": 4, "learning_rate": 0.1}
    with pytest.raises(ConfigError, match="unknown field 'learning_rate'"):
        parse_dict(data)
    assert parse_dict(data, allow_extra_keys=True) == WatchConfig(max_frames_to_save=4)
    with pytest.raises(ConfigError, match="field 'max_frames_to_save'"):
        parse_dict({"max_frames_to_save": "lots", "other": 1}, allow_extra_keys=True)
    with pytest.raises(ConfigError, match="expected a mapping of WatchConfig fields, got list"):
        parse_dict([("max_frames_to_save", 4)])  # type: ignore[arg-type]
