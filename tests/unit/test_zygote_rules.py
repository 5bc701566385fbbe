"""The zygote's rule for PYTHONPATH (infra/zygote._shadowing): a child whose PYTHONPATH holds another copy of a
module the zygote imported starts fresh (it would import that copy); an entry holding the very files the zygote
loaded (the checkout an editable install points at, which every engine server gets on its PYTHONPATH) does not
stop the fork."""
from __future__ import annotations

import os
import sys

from engine import launcher
from infra import zygote


def test_an_entry_with_another_copy_of_a_loaded_package_shadows_it(tmp_path):
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "__init__.py").write_text("")
    (tmp_path / "zygote_rules_unloaded.py").write_text("")
    assert zygote._shadowing(str(tmp_path)) == [str(tmp_path)]


def test_an_entry_with_only_unloaded_names_or_missing_shadows_nothing(tmp_path):
    (tmp_path / "zygote_rules_unloaded").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "json.yaml").write_text("")  # named like a loaded module, but no module (prefect.yaml in a checkout)
    (tmp_path / "os.txt").write_text("")
    assert zygote._shadowing(os.pathsep.join([str(tmp_path), str(tmp_path / "absent"), ""])) == []


def test_the_checkout_the_loaded_modules_come_from_shadows_nothing(tmp_path, monkeypatch):
    root = launcher.REPO_ROOT
    assert (root / "engine" / "launcher.py").is_file() and (root / "infra" / "zygote.py").is_file()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") != os.path.realpath(root)])
    monkeypatch.chdir(tmp_path)  # sys.path's "" would be the checkout otherwise
    assert zygote._shadowing(str(root)) == []
    # through a symlink too: origins compare as real paths
    (tmp_path / "link").symlink_to(root)
    assert zygote._shadowing(str(tmp_path / "link")) == []


def test_a_server_runs_in_the_checkout_with_it_first_on_its_pythonpath():
    env = launcher.server_env(launcher.ServerSpec(name="t", model_path="/m"), {"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launcher.REPO_ROOT), "/x"]
    assert (launcher.REPO_ROOT / "pyproject.toml").is_file()


def test_pythonpath_first_puts_the_entry_before_the_environments_own():
    from infra.procs import pythonpath_first

    assert pythonpath_first("/repo", {"PYTHONPATH": "/a" + os.pathsep + "/b"}) == os.pathsep.join(["/repo", "/a", "/b"])
    assert pythonpath_first("/repo", {}) == pythonpath_first("/repo", {"PYTHONPATH": ""}) == "/repo"


def test_only_package_directories_py_files_and_extension_modules_provide_modules(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "not-a-name").mkdir()
    assert zygote._module_name(str(tmp_path), "pkg") == "pkg"
    assert zygote._module_name(str(tmp_path), "not-a-name") is None
    assert zygote._module_name(str(tmp_path), "mod.py") == "mod"
    assert zygote._module_name(str(tmp_path), "ext.cpython-311-x86_64-linux-gnu.so") == "ext"
    assert zygote._module_name(str(tmp_path), "ext.abi3.so") == zygote._module_name(str(tmp_path), "ext.pyd") == "ext"
    for other in ("prefect.yaml", "disk.iso", "README.md", "Makefile"):
        assert zygote._module_name(str(tmp_path), other) is None
