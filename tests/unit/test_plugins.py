"""The plug-in loader (swarmrl/plugins.py): names, the command line, and what each failure says."""

from __future__ import annotations

import pytest

from swarmrl import plugins
from swarmrl.plugins import PluginError


def test_plugin_flags_are_taken_out_of_any_command_line():
    found, rest = plugins.split_argv(["worker", "--plugin", "a.b", "--name", "w", "--plugin=c", "--dry-run"])
    assert found == ["a.b", "c"] and rest == ["worker", "--name", "w", "--dry-run"]
    with pytest.raises(PluginError, match="--plugin needs a module name"):
        plugins.split_argv(["worker", "--plugin"])
    with pytest.raises(PluginError, match="--plugin needs a module name"):
        plugins.split_argv(["worker", "--plugin", "--name"])


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("os", "standard library, not a plug-in"),
        ("subprocess", "standard library, not a plug-in"),
        ("a b", "give a module's dotted import name"),
        ("../x", "give a module's dotted import name"),
        (3, "give a module's dotted import name"),
    ],
)
def test_a_name_that_is_not_a_plugin_is_refused(name, needle):
    with pytest.raises(PluginError, match=needle):
        plugins.check_name(name)


def test_each_failure_names_the_plugin_and_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(PluginError, match="'no_such_plugin_pkg' .* is not installed here: install the package"):
        plugins.load(["no_such_plugin_pkg"])
    (tmp_path / "broken_plugin_mod.py").write_text("raise RuntimeError('my bug')\n")
    (tmp_path / "needy_plugin_mod.py").write_text("import no_such_dependency_here\n")
    (tmp_path / "fine_plugin_mod.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="'broken_plugin_mod' .* failed to import: RuntimeError: my bug"):
        plugins.load(["broken_plugin_mod"])
    with pytest.raises(PluginError, match="needs 'no_such_dependency_here', not installed"):
        plugins.load(["needy_plugin_mod"])
    # A run's plug-ins, as a worker learns them: every missing one named at once, nothing imported.
    with pytest.raises(PluginError, match="plug-ins 'gone_a', 'gone_b' .* not installed here"):
        plugins.follow(["fine_plugin_mod", "gone_a", "gone_b"], where="the run's plugins")
    assert "fine_plugin_mod" not in plugins.loaded()
    assert plugins.follow(["fine_plugin_mod"], where="the run's plugins") == ["fine_plugin_mod"]
    assert "fine_plugin_mod" in plugins.loaded()
