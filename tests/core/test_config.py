"""core/config/: one WatchConfig from keyword arguments, a dict or a YAML/JSON file; every mistake names its field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import nanwatch
from nanwatch.core.config import ConfigError, WatchConfig, resolve_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults() -> None:
    config = WatchConfig()
    assert config.max_frames_to_save == 21
    assert config.trace_batch_nums == []
    assert config.abort_after_batch_num is None
    assert config.report_dir is None
    assert config.watch_eval is False
    assert config.trace_ranks == "zero"


def test_from_keyword_arguments_dict_and_overrides(tmp_path: Path) -> None:
    fields = {"max_frames_to_save": 5, "trace_batch_nums": [1, 3], "abort_after_batch_num": 4, "watch_eval": True}
    by_kwargs = WatchConfig(**fields, report_dir=tmp_path)
    by_dict = WatchConfig.from_dict({**fields, "report_dir": str(tmp_path)})
    by_resolve = resolve_config(None, **fields, report_dir=tmp_path)
    by_resolve_dict = resolve_config({**fields, "report_dir": str(tmp_path)})
    assert by_kwargs == by_dict == by_resolve == by_resolve_dict
    assert by_dict.report_dir == tmp_path
    assert isinstance(by_dict.report_dir, Path)

    overridden = resolve_config(by_dict, max_frames_to_save=2)
    assert overridden.max_frames_to_save == 2
    assert overridden.trace_batch_nums == [1, 3]
    assert by_dict.max_frames_to_save == 5  # the original is not changed
    assert resolve_config(by_dict) is by_dict


def test_yaml_and_json_files(tmp_path: Path) -> None:
    data = {"max_frames_to_save": 7, "trace_batch_nums": [0, 2], "trace_ranks": [0, 1], "report_dir": "out"}
    yaml_path = tmp_path / "watch.yaml"
    yaml_path.write_text(yaml.safe_dump(data))
    yml_path = tmp_path / "watch.yml"
    yml_path.write_text(yaml.safe_dump(data))
    json_path = tmp_path / "watch.JSON"
    json_path.write_text(json.dumps(data))
    configs = [WatchConfig.from_file(yaml_path), WatchConfig.from_file(str(yml_path)), resolve_config(json_path)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].trace_ranks == [0, 1]
    assert configs[0].report_dir == Path("out")

    with_override = resolve_config(str(yaml_path), abort_after_batch_num=9)
    assert with_override.abort_after_batch_num == 9
    assert with_override.max_frames_to_save == 7


def test_empty_files_give_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    (tmp_path / "empty.json").write_text("  \n")
    assert WatchConfig.from_file(tmp_path / "empty.yaml") == WatchConfig()
    assert WatchConfig.from_file(tmp_path / "empty.json") == WatchConfig()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"max_frames_to_save": 0}, "max_frames_to_save"),
        ({"max_frames_to_save": -3}, "max_frames_to_save"),
        ({"max_frames_to_save": "many"}, "max_frames_to_save"),
        ({"max_frames_to_save": 2.5}, "max_frames_to_save"),
        ({"trace_batch_nums": [1, -2]}, "trace_batch_nums"),
        ({"trace_batch_nums": "1,2"}, "trace_batch_nums"),
        ({"trace_batch_nums": [1, "x"]}, "trace_batch_nums"),
        ({"abort_after_batch_num": -1}, "abort_after_batch_num"),
        ({"abort_after_batch_num": "soon"}, "abort_after_batch_num"),
        ({"report_dir": 12}, "report_dir"),
        ({"watch_eval": "sometimes"}, "watch_eval"),
        ({"trace_ranks": "first"}, "trace_ranks"),
        ({"trace_ranks": [0, -1]}, "trace_ranks"),
        # YAML reads `true` as a bool; a bool is never a count or a batch number.
        ({"max_frames_to_save": True}, "max_frames_to_save"),
        ({"abort_after_batch_num": False}, "abort_after_batch_num"),
        ({"trace_batch_nums": [True, 2]}, "trace_batch_nums"),
        ({"trace_ranks": [True]}, "trace_ranks"),
    ],
)
def test_bad_values_name_the_field_and_what_was_received(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)) as info:
        WatchConfig.from_dict(data)
    assert isinstance(info.value, ValueError)
    # The same mistake through every door gives the same kind of error.
    with pytest.raises(ConfigError, match=re.escape(field)):
        resolve_config(None, **data)
    with pytest.raises(ConfigError, match=re.escape(field)):
        nanwatch.watch(torch.nn.Linear(1, 1), **data)


def test_the_class_itself_gives_the_same_short_error_with_its_did_you_mean() -> None:
    # Before: `WatchConfig(...)` raised pydantic's raw ValidationError, many lines, and no "did you mean".
    with pytest.raises(ConfigError) as info:
        WatchConfig(trace_batch_num=[1])  # type: ignore[call-arg]
    message = str(info.value)
    assert message == "WatchConfig: unknown field 'trace_batch_num' (did you mean 'trace_batch_nums'?)"
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match=r"^WatchConfig: field 'max_frames_to_save': .*\(got 0\)$"):
        WatchConfig(max_frames_to_save=0)
    with pytest.raises(ConfigError, match="^WatchConfig: capture_on_detect=True needs report_dir"):
        WatchConfig(capture_on_detect=True)
    config = WatchConfig()
    with pytest.raises(ConfigError, match=r"^WatchConfig: field 'watch_every_n_batches': .*\(got 0\)$"):
        config.watch_every_n_batches = 0  # assignments are validated too
    assert config.watch_every_n_batches == 1
    config.watch_every_n_batches = 2
    assert config.watch_every_n_batches == 2
    # The other doors keep their own prefix, with no double wrapping.
    with pytest.raises(ConfigError, match="^overrides: unknown field 'trace_batch_num'"):
        WatchConfig().with_overrides(trace_batch_num=[1])
    with pytest.raises(ConfigError, match="^config: unknown field 'trace_batch_num'"):
        WatchConfig.from_dict({"trace_batch_num": [1]})


def test_error_shows_the_received_value() -> None:
    with pytest.raises(ConfigError, match=r"max_frames_to_save.*got 0"):
        WatchConfig.from_dict({"max_frames_to_save": 0})


def test_unknown_keys_are_named_with_the_known_field_meant(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown field 'max_frames'") as info:
        WatchConfig.from_dict({"max_frames": 3})
    assert "max_frames_to_save" in str(info.value)  # the known field it was likely meant to be

    path = tmp_path / "typo.yaml"
    path.write_text("trace_batch_num: [1]\n")
    with pytest.raises(ConfigError, match="trace_batch_num") as info:
        WatchConfig.from_file(path)
    assert str(path) in str(info.value)

    with pytest.raises(ConfigError, match="unknown field 'colour'"):
        nanwatch.watch(torch.nn.Linear(1, 1), colour="red")
    with pytest.raises(ConfigError, match="unknown field 'colour'"):
        WatchConfig().with_overrides(colour="red")


def test_several_problems_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        WatchConfig.from_dict({"max_frames_to_save": 0, "abort_after_batch_num": -1, "oops": 1})
    message = str(info.value)
    assert "max_frames_to_save" in message
    assert "abort_after_batch_num" in message
    assert "oops" in message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "watch.yaml"
    with pytest.raises(ConfigError, match="cannot read config file") as info:
        WatchConfig.from_file(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="cannot read config file"):
        nanwatch.watch(torch.nn.Linear(1, 1), str(missing))


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot read config file"):
        WatchConfig.from_file(folder)


def test_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "watch.toml"
    path.write_text("max_frames_to_save = 3\n")
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml or \.json"):
        WatchConfig.from_file(path)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("broken.yaml", "max_frames_to_save: [1, 2\n", "not valid YAML"),
        ("broken.json", '{"max_frames_to_save": ', "not valid JSON"),
        ("list.yaml", "- 1\n- 2\n", "expected a mapping of WatchConfig fields, got list"),
        ("scalar.json", "3", "expected a mapping of WatchConfig fields, got int"),
    ],
)
def test_malformed_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        WatchConfig.from_file(path)
    assert str(path) in str(info.value)


def test_from_dict_rejects_a_non_mapping() -> None:
    with pytest.raises(ConfigError, match="got list"):
        WatchConfig.from_dict([("max_frames_to_save", 3)])  # type: ignore[arg-type]


def test_resolve_config_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match="got int"):
        resolve_config(21)  # type: ignore[arg-type]


def test_assignment_is_validated() -> None:
    config = WatchConfig()
    with pytest.raises(ValueError, match="max_frames_to_save"):
        config.max_frames_to_save = 0


# ------------------------------------------------------------------------------------------------------ presets


def test_presets_exist() -> None:
    assert (CONFIGS / "default.yaml").is_file()
    assert (CONFIGS / "trace.yaml").is_file()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(path: Path) -> None:
    config = WatchConfig.from_file(path)
    assert isinstance(config, WatchConfig)
    handle = nanwatch.watch(torch.nn.Linear(2, 2), path)  # and every entry point takes it
    try:
        assert handle.config == config
    finally:
        handle.close()


def test_default_preset_is_the_defaults_and_documents_every_field() -> None:
    path = CONFIGS / "default.yaml"
    assert WatchConfig.from_file(path) == WatchConfig()
    text = path.read_text()
    data = yaml.safe_load(text)
    assert set(data) == set(WatchConfig.model_fields), "default.yaml must list every WatchConfig field"
    lines = text.splitlines()
    for field in WatchConfig.model_fields:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{field}:"))
        assert lines[index - 1].startswith("#"), f"default.yaml: {field} needs a comment above it"


def test_trace_preset_traces_and_stops() -> None:
    config = WatchConfig.from_file(CONFIGS / "trace.yaml")
    assert config.trace_batch_nums
    assert config.abort_after_batch_num is not None
    assert config.report_dir is not None
    text = (CONFIGS / "trace.yaml").read_text()
    for field in yaml.safe_load(text):
        assert re.search(rf"#.*\n{field}:", text), f"trace.yaml: {field} needs a comment above it"


# ------------------------------------------------------------------------------------------- hostile config files


def _nested_aliases() -> str:
    """A "billion laughs": each list holds 9 aliases of the one before, so about 330 bytes of YAML stand for 9**9
    (387 million) strings once aliases are followed."""
    names = "abcdefghi"
    lines = ["a: &a [" + ",".join("x" * 9) + "]"]
    pairs = zip(names[:-1], names[1:], strict=True)
    lines += [f"{name}: &{name} [" + ",".join([f"*{before}"] * 9) + "]" for before, name in pairs]
    lines.append("max_frames_to_save: *i")
    return "\n".join(lines) + "\n"


def test_a_yaml_file_of_nested_aliases_is_refused_in_a_short_message(tmp_path: Path) -> None:
    # Before: validating (and echoing) the expanded document ran out of memory or never ended.
    path = tmp_path / "laughs.yaml"
    path.write_text(_nested_aliases())
    assert path.stat().st_size < 400
    for load in (lambda: WatchConfig.from_file(path), lambda: nanwatch.watch(torch.nn.Linear(1, 1), path)):
        with pytest.raises(ConfigError, match="holds more than 10000 values") as info:
            load()
        message = str(info.value)
        assert len(message) < 500
        assert "\n" not in message
        assert str(path) in message
        assert "anchors and aliases" in message


def test_a_huge_nested_bad_value_is_echoed_cut_short(tmp_path: Path) -> None:
    # 40 x 40 strings of 200 characters: few enough values to be validated, a repr of over 300 kB.
    huge = [["y" * 200] * 40] * 40
    with pytest.raises(ConfigError, match="field 'max_frames_to_save'") as info:
        WatchConfig.from_dict({"max_frames_to_save": huge})
    message = str(info.value)
    assert len(message) < 500
    assert "(got [['yyyy" in message  # the value is still shown, from its start ...
    assert message.endswith("...)")  # ... and cut, saying so

    # The same through a small YAML file whose aliases expand to that value.
    row = "[&s " + '"' + "y" * 200 + '"' + ", *s" * 39 + "]"
    path = tmp_path / "wide.yaml"
    path.write_text("max_frames_to_save: [&row " + row + ", *row" * 39 + "]\n")
    with pytest.raises(ConfigError, match="field 'max_frames_to_save'") as info:
        WatchConfig.from_file(path)
    assert len(str(info.value)) < 500
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "byte"),
    [
        ("binary.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "byte 0 is 0x89"),
        ("latin1.yaml", "report_dir: résultats\n".encode("latin-1"), "byte 13 is 0xe9"),
        ("latin1.json", '{"report_dir": "résultats"}'.encode("latin-1"), "byte 17 is 0xe9"),
    ],
    ids=["binary", "latin-1-yaml", "latin-1-json"],
)
def test_a_file_that_is_not_utf8_is_a_one_line_config_error(
    tmp_path: Path, name: str, content: bytes, byte: str
) -> None:
    # Before: UnicodeDecodeError, a traceback that named no file.
    path = tmp_path / name
    path.write_bytes(content)
    for load in (lambda: WatchConfig.from_file(path), lambda: nanwatch.watch(torch.nn.Linear(1, 1), path)):
        with pytest.raises(ConfigError, match="is not UTF-8 text") as info:
            load()
        message = str(info.value)
        assert "\n" not in message
        assert str(path) in message
        assert byte in message


@pytest.mark.parametrize("value", [10**9, 10**30], ids=["1e9", "1e30"])
def test_max_frames_to_save_beyond_its_limit_is_a_config_error(value: int) -> None:
    # Before: 10**9 was taken (and every report would try to hold that many frames); 10**30 ended in OverflowError.
    expected = r"field 'max_frames_to_save': Input should be less than or equal to 10000"
    with pytest.raises(ConfigError, match=expected):
        WatchConfig.from_dict({"max_frames_to_save": value})
    with pytest.raises(ConfigError, match=expected):
        nanwatch.watch(torch.nn.Linear(1, 1), max_frames_to_save=value)
    assert WatchConfig(max_frames_to_save=10_000).max_frames_to_save == 10_000  # the limit itself is allowed


def test_a_rerun_records_the_whole_model_and_does_nothing_else() -> None:
    """Sentinel mode's replays run under `for_rerun()`: every module of the replayed micro-batch recorded whatever the
    run's schedule, and nothing that writes, warns, judges spikes, skips or guards checkpoints; the choice of modules
    (include/exclude) is the run's own."""
    config = WatchConfig(
        mode="sentinel",
        report_dir="reports",
        spike_window=20,
        on_detect="skip",
        checkpoint_guard="quarantine",
        watch_every_n_batches=4,
        watch_first_batch=3,
        watch_last_batch=50,
        abort_after_batch_num=9,
        exclude_modules=["lm_head"],
    )
    rerun = config.for_rerun(gradients=True)
    assert (rerun.mode, rerun.watch_gradients, rerun.report_dir) == ("full", True, None)
    assert (rerun.spike_window, rerun.on_detect, rerun.checkpoint_guard) == (None, "raise", "off")
    assert (rerun.watch_every_n_batches, rerun.watch_first_batch, rerun.watch_last_batch) == (1, 0, None)
    assert rerun.abort_after_batch_num is None
    assert rerun.exclude_modules == ["lm_head"]
    assert config.for_rerun(gradients=False).watch_gradients is False


# Every field that takes a number (an int or a float; alone, optional, or in a list).
NUMBER_FIELDS = [
    name
    for name, info in WatchConfig.model_fields.items()
    if re.search(r"\b(int|float)\b", str(info.annotation)) and info.annotation is not bool
]


def test_the_number_fields_are_all_found() -> None:
    assert {"spike_zscore", "spike_factor", "rank_wait_s", "max_frames_to_save", "trace_ranks"} <= set(NUMBER_FIELDS)
    assert "watch_eval" not in NUMBER_FIELDS


@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_no_number_field_takes_a_boolean_through_any_door(field: str, tmp_path: Path) -> None:
    # Before: `spike_zscore: yes` in a YAML file was read as 6.0's replacement 1.0 (spike_factor, rank_wait_s the
    # same), while the whole-number fields and the fractions refused it.
    value: Any = [True] if "list" in str(WatchConfig.model_fields[field].annotation) else True
    yaml_file, json_file = tmp_path / "c.yaml", tmp_path / "c.json"
    yaml_file.write_text(f"{field}: {'[yes]' if isinstance(value, list) else 'yes'}\n")
    json_file.write_text(json.dumps({field: value}))
    doors = [
        lambda: WatchConfig.from_file(yaml_file),
        lambda: WatchConfig.from_file(json_file),
        lambda: WatchConfig.from_dict({field: value}),
        lambda: WatchConfig(**{field: value}),
        lambda: resolve_config(None, **{field: value}),
        lambda: nanwatch.watch(torch.nn.Linear(1, 1), **{field: value}),
    ]
    for door in doors:
        with pytest.raises(ConfigError, match=rf"field {field!r}: expected .*not (a )?boolean"):
            door()
    config = WatchConfig()
    with pytest.raises(ConfigError, match=rf"field {field!r}"):
        setattr(config, field, value)


@pytest.mark.parametrize(
    ("key", "hint"),
    [("max_frame_to_save", "(did you mean 'max_frames_to_save'?)"), ("colour", "(`nanwatch config` lists the fields)")],
)
def test_an_unknown_field_is_one_short_line(key: str, hint: str, tmp_path: Path) -> None:
    # Before: the did-you-mean was followed by every known field, 620 characters.
    path = tmp_path / "typo.yaml"
    path.write_text(f"{key}: 3\n")
    for door in (
        lambda: WatchConfig.from_dict({key: 3}),
        lambda: WatchConfig(**{key: 3}),
        lambda: WatchConfig().with_overrides(**{key: 3}),
        lambda: WatchConfig.from_file(path),
    ):
        with pytest.raises(ConfigError) as info:
            door()
        message = str(info.value)
        assert message.endswith(f"unknown field {key!r} {hint}")
        assert "\n" not in message
        assert len(message) - len(str(path)) < 200
        assert "spike_zscore" not in message  # not the list of every field
