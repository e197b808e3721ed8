"""`nanwatch config`: the config files installed with nanwatch (package data), the same as the repository's
configs/, each one a `WatchConfig` that survives a round trip."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml

from nanwatch.cli import main
from nanwatch.cli.config import preset_names, preset_text
from nanwatch.core.config import WatchConfig

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_configs_are_the_repositorys() -> None:
    # configs/ is where README and the examples point; src/nanwatch/configs/ is what an installed nanwatch has.
    shipped = {path.name: path.read_bytes() for path in (REPO / "src" / "nanwatch" / "configs").glob("*.yaml")}
    top = {path.name: path.read_bytes() for path in (REPO / "configs").glob("*.yaml")}
    assert shipped == top, "configs/*.yaml and src/nanwatch/configs/*.yaml must be the same files: copy one over"
    assert preset_names() == ["default", "trace"]
    package = resources.files("nanwatch").joinpath("configs")
    for name in preset_names():
        assert package.joinpath(f"{name}.yaml").read_bytes() == top[f"{name}.yaml"]
    # ... and the wheel takes them: setuptools installs only the package data pyproject.toml names.
    section = (REPO / "pyproject.toml").read_text(encoding="utf-8").split("[tool.setuptools.package-data]")[1]
    package_data = next(line for line in section.splitlines() if line.startswith("nanwatch = ["))
    assert '"configs/*.yaml"' in package_data


def test_nanwatch_config_prints_the_default_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (REPO / "configs" / "default.yaml").read_text(encoding="utf-8")
    # `nanwatch config > my.yaml` starts a user off: it loads, and it is the defaults.
    mine = tmp_path / "my.yaml"
    mine.write_text(out, encoding="utf-8")
    assert WatchConfig.from_file(mine) == WatchConfig()
    assert main(["config", "trace"]) == 0
    assert capsys.readouterr().out == preset_text("trace")


def test_the_default_config_round_trips_through_watchconfig() -> None:
    data = yaml.safe_load(preset_text("default"))
    assert list(data) == list(WatchConfig.model_fields), "every field, in the model's order"
    config = WatchConfig.model_validate(data)
    assert config.model_dump(mode="json") == data  # nothing lost, nothing changed on the way through
    assert WatchConfig.model_validate(yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))) == config
    lines = preset_text("default").splitlines()
    for field in data:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{field}:"))
        assert lines[index - 1].startswith("#"), f"default.yaml: {field} needs a comment above it"


def test_every_installed_config_loads() -> None:
    for name in preset_names():
        loaded = WatchConfig.model_validate(yaml.safe_load(preset_text(name)))
        assert isinstance(loaded, WatchConfig)


def test_an_unknown_name_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "defualt"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "nanwatch config: no config named 'defualt'; the installed ones are default, trace\n")
