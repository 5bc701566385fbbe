"""scripts/install.py hands pip's settings to uv: what `pip config list` prints becomes uv's variables."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from install import parse_pip_config, uv_env  # noqa: E402

pytestmark = pytest.mark.unit

LISTED = """:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple\\nfile:///opt/more/simple'
global.find-links='/ignored/by/env'
global.index-url='https://mirror.example/simple'
install.trusted-host='mirror.example other.example'
"""


def test_sections_merge_with_env_winning_and_values_split():
    s = parse_pip_config(LISTED)
    assert s["find-links"] == ["/opt/wheels"]  # PIP_FIND_LINKS over the config file's
    assert s["extra-index-url"] == ["file:///opt/pypi/simple", "file:///opt/more/simple"]
    assert s["trusted-host"] == ["mirror.example", "other.example"]
    assert s["constraint"] == ["/etc/xdg/pip/constraints.txt"]


def test_uv_reads_what_pip_reads():
    env = uv_env(parse_pip_config(LISTED))
    assert env["UV_DEFAULT_INDEX"] == "https://mirror.example/simple"
    assert env["UV_EXTRA_INDEX_URL"] == "file:///opt/pypi/simple file:///opt/more/simple"
    assert env["UV_FIND_LINKS"] == "/opt/wheels" and env["UV_INSECURE_HOST"] == "mirror.example other.example"
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca.crt" and env["UV_HTTP_TIMEOUT"] == "180"
    assert env["UV_INDEX_STRATEGY"] == "unsafe-best-match"  # pip considers every index, so must uv
    assert "UV_CONSTRAINT" not in env  # constraint files go on the command line, beside constraints.txt
    assert "UV_NO_INDEX" not in env and uv_env(parse_pip_config("global.no-index='true'"))["UV_NO_INDEX"] == "1"
