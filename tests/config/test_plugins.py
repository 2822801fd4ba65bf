"""User plugins: a scorer defined outside kvlab (tests/fixtures/plugins/my_scorers.py) loaded through a
config's ``imports:`` and run end to end, module names from the working directory, ``imports``
across preset inheritance, the ``kvlab.plugins`` entry points, and the errors for missing modules."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from support.paths import FIXTURES

import kvlab.models
from kvlab.cli.main import main
from kvlab.compression.importance import IMPORTANCE
from kvlab.config import plugins
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve

PLUGIN = FIXTURES / "plugins" / "my_scorers.py"
TINY = [
    "--model.model",
    "tiny-llama",
    "--trainer.enable_progress_bar",
    "false",
    "--model.max_new_tokens",
    "3",
]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load model weights."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration error was reported")

    monkeypatch.setattr(kvlab.models, "load_model", forbidden)


@pytest.fixture
def own_registry(monkeypatch):
    """Registrations made by the test are undone afterwards (the registry is process-wide)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(IMPORTANCE.names())
    yield
    for name in set(IMPORTANCE.names()) - before:
        IMPORTANCE.unregister(name)


def write_config(path: Path, imports: list[str]) -> Path:
    path.write_text(f"preset: snapkv\nimports: {json.dumps(imports)}\n")
    return path


def predict(tmp_path, config, *args):
    main(
        [
            "predict",
            "--config",
            str(config),
            *args,
            "--run.dir",
            str(tmp_path / "runs"),
            "--run.experiment",
            "exp",
            "--run.method",  # command-line overrides would otherwise name the run
            "snapkv",
        ]
    )


def test_scorer_from_a_plugin_file_runs_end_to_end_and_is_recorded(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "prompt": "word " * 40}) + "\n" for i in range(2)))
    # a path relative to the config file that lists it
    config = write_config(tmp_path / "mine.yaml", [os.path.relpath(PLUGIN, tmp_path)])
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    predict(
        tmp_path,
        config,
        *TINY,
        "--data.dataset",
        f"{{name: jsonl, path: {data}}}",
        "--model.compression.budget",
        "{tokens: 24, window: 4}",
        "--model.compression.importance.attention",  # snapkv's scorer role, now played by the plugin
        "{name: my_scorer, scale: 2.0}",
    )
    # the run says what code it imports, and which config asked for it, once
    out = capsys.readouterr().out
    assert out.count("kvlab: imports plugin") == 1
    assert f"kvlab: imports plugin file {PLUGIN} (listed by {config.resolve()})" in out
    scorer = IMPORTANCE.get("my_scorer")
    assert scorer.__module__ == "my_scorers" and sys.modules["my_scorers"].__file__ == str(PLUGIN)
    assert set(scorer.calls) == {0, 1}  # tiny-llama's two layers were scored by the plugin
    run = tmp_path / "runs" / "exp" / "snapkv"  # the preset names the method
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["s0", "s1"]
    assert all(c == 24 for r in records for row in r["kept_per_layer_head"] for c in row)
    config_text = (run / "config.yaml").read_text()
    assert "my_scorer" in config_text and f"imports:\n- {PLUGIN}" in config_text
    assert not list(temp_dir.iterdir())  # the run leaves no temporary file behind


def test_module_name_imports_from_the_working_directory(tmp_path, monkeypatch, own_registry):
    (tmp_path / "team_scorers.py").write_text(
        "from dataclasses import dataclass\n"
        "from kvlab.compression.importance import IMPORTANCE, KeyNormScorer\n\n\n"
        '@IMPORTANCE.register("team_scorer")\n@dataclass\nclass TeamScorer(KeyNormScorer):\n'
        '    """Key norm under another name."""\n'
    )
    (tmp_path / "configs").mkdir()
    config = write_config(tmp_path / "configs" / "team.yaml", ["team_scorers"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "team_scorers", raising=False)
    assert "team_scorer" not in IMPORTANCE
    imports = resolve([str(config)], [])["imports"]
    assert imports == ["team_scorers"]
    plugins.import_plugins(imports)
    assert IMPORTANCE.build({"name": "team_scorer", "sign": 1}).sign == 1
    plugins.import_plugins(imports)  # a second run in the same process reuses the module
    monkeypatch.delitem(sys.modules, "team_scorers")


def test_imports_of_inherited_configs_are_concatenated_relative_to_their_files(tmp_path):
    (tmp_path / "base").mkdir()
    write_config(tmp_path / "base" / "shared.yaml", ["extra/one.py", "team_scorers"])
    (tmp_path / "child.yaml").write_text("preset: base/shared.yaml\nimports: [two.py, team_scorers]\n")
    cfg = resolve([str(tmp_path / "child.yaml")], [])
    assert cfg["imports"] == [
        str(tmp_path / "base" / "extra" / "one.py"),
        "team_scorers",
        str(tmp_path / "two.py"),
    ]
    assert cfg["model"]["compression"] == resolve(["snapkv"], [])["model"]["compression"]


@pytest.mark.parametrize(
    "imports, message",
    [
        (["no_such_kvlab_plugin"], "the module 'no_such_kvlab_plugin', which cannot be found"),
        (["plugins/missing_scorers.py"], "missing_scorers.py', which does not exist or is not a .py file"),
        ("[{name: x}]", "must be a list of module names or .py file paths"),
    ],
)
def test_missing_plugin_is_a_config_error_before_the_model_loads(
    tmp_path, capsys, no_model_load, imports, message
):
    config = tmp_path / "bad.yaml"
    config.write_text(
        f"preset: snapkv\nimports: {imports if isinstance(imports, str) else json.dumps(imports)}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, config, *TINY)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "kvlab: error:" in err and "`imports`" in err and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


class FakeEntryPoint:
    """Stands in for an installed distribution's ``kvlab.plugins`` entry point."""

    def __init__(self, name, action):
        self.name, self.value, self.action, self.loads = name, f"fake_pkg.{name}", action, 0

    def load(self):
        self.loads += 1
        return self.action()


def fake_entry_points(monkeypatch, *points):
    monkeypatch.setattr(plugins, "entry_points_loaded", False)
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: list(points) if group == plugins.ENTRY_POINT_GROUP else []
    )


def register_ep_scorer():
    from dataclasses import dataclass

    from kvlab.compression.importance import KeyNormScorer

    @IMPORTANCE.register("ep_scorer")
    @dataclass
    class EntryPointScorer(KeyNormScorer):
        """A scorer from an installed plugin."""

    return EntryPointScorer


def test_entry_point_plugins_load_once_on_the_first_lookup(monkeypatch, own_registry):
    point = FakeEntryPoint("ep_plugin", register_ep_scorer)
    fake_entry_points(monkeypatch, point)
    assert "ep_scorer" not in IMPORTANCE
    assert IMPORTANCE.build({"name": "ep_scorer"}).sign == -1
    IMPORTANCE.get("window_attention")
    assert point.loads == 1


def test_entry_point_plugins_load_when_the_command_starts(monkeypatch, own_registry, capsys):
    point = FakeEntryPoint("ep_plugin", register_ep_scorer)
    fake_entry_points(monkeypatch, point)
    main(["list"])
    assert "ep_scorer: A scorer from an installed plugin." in capsys.readouterr().out
    assert point.loads == 1


def test_broken_entry_point_is_a_config_error(monkeypatch):
    def fail():
        raise ModuleNotFoundError("No module named 'fake_pkg'")

    fake_entry_points(monkeypatch, FakeEntryPoint("broken", fail))
    with pytest.raises(ConfigError, match="kvlab plugin 'broken'.*fake_pkg.broken.*kvlab.plugins"):
        plugins.load_entry_points()


def test_a_run_names_each_plugin_and_the_preset_two_levels_up_that_listed_it(tmp_path, capsys):
    """``imports:`` inherited from a preset's preset is announced with that file, before it runs."""
    from kvlab.cli.predict import announce_plugins
    from kvlab.config.loader import resolve

    (tmp_path / "plugins").mkdir()
    plugin = tmp_path / "plugins" / "extra.py"
    plugin.write_text("RAN = True\n")
    (tmp_path / "grand.yaml").write_text("preset: snapkv\nimports: [plugins/extra.py]\n")
    (tmp_path / "parent.yaml").write_text(f"preset: {tmp_path / 'grand.yaml'}\n")
    (tmp_path / "child.yaml").write_text(f"preset: {tmp_path / 'parent.yaml'}\n")
    configs = [str(tmp_path / "child.yaml")]
    imports = resolve(configs, [])["imports"]
    announce_plugins(configs, imports)
    assert capsys.readouterr().out == (
        f"kvlab: imports plugin file {plugin} (listed by {tmp_path / 'grand.yaml'})\n"
    )
