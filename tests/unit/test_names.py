"""Names that become paths (issue 34, part 4): run, experiment and domain names match one safe pattern when the config
loads, the error naming the dotted path; storage keys and local work paths are built by one function
(`infra.names.key`, used by `infra.storage.join` and `local_path`) that refuses `..` and absolute parts."""
from pathlib import Path

import pytest
import yaml

from infra.config import ConfigError, config_from_dict
from infra.names import check_name, key, local_path, name_problem
from infra.storage import join
from tasks.prefixes import specialist_prefix_of

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GOOD = ["alloy", "tool_add", "max_list", "wordmath", "gpu-1", "alloy-demo", "Run.2", "a", "x" * 64]
BAD = ["../../../../tmp/x", "..", ".", ".hidden", "a/b", "a\\b", "a b", "", "-x", "_x", "a..b", "x" * 65, "é", "a\n",
       "s3://b/k", "~root", "a:b"]


@pytest.mark.parametrize("name", GOOD)
def test_safe_names_pass(name):
    assert check_name(name) == name and name_problem(name) is None


@pytest.mark.parametrize("name", BAD)
def test_unsafe_names_are_refused(name):
    with pytest.raises(ValueError, match=r"name .*: must be 1 to 64 characters"):
        check_name(name)


def test_the_config_refuses_unsafe_names_with_the_dotted_path(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n')
    cfg = {"run": {"name": "../../x"}, "tracking": {"experiment": "a/b"},
           "domains": [{"name": "add"}, {"name": "tool_add"}, {"name": "reverse"},
                       {"name": "../../../../tmp/x", "dataset": {"path": str(data)}}]}
    with pytest.raises(ConfigError) as err:
        config_from_dict(cfg)
    msg = str(err.value)
    for path in ("run.name", "tracking.experiment", "domains.3.name"):
        assert f"\n  {path}: must be 1 to 64 characters" in msg, msg
    assert "domains.0.name" not in msg and "domains.1.name" not in msg


def test_every_name_in_the_shipped_configs_is_safe():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        names = [d["name"] for d in cfg["domains"]] + [cfg.get("run", {}).get("name", "alloy"),
                                                      cfg.get("tracking", {}).get("experiment", "alloy")]
        assert [n for n in names if name_problem(n)] == [], path.name


def test_keys_refuse_dotdot_and_absolute_parts():
    assert key("specialist-add-0123abcdef", "final") == "specialist-add-0123abcdef/final"
    assert key("step-1/", "x.json") == "step-1/x.json"
    assert join("s3://b/p", "a", "b/c") == "s3://b/p/a/b/c"
    assert local_path("/w", "specialists", "tool_add", "final-local") == Path("/w/specialists/tool_add/final-local")
    for bad in ("..", "../x", "a/../../x", "./a", "/etc", "~/x", "C:/x", "s3://other/k", "a//b", "a\\b", "a\0b", ""):
        with pytest.raises(ValueError, match="storage key part"):
            key("ok", bad)
        with pytest.raises(ValueError, match="storage key part"):
            local_path("/w", "specialists", bad)


def test_a_prefix_refuses_an_unsafe_domain_even_past_the_config():
    cfg = config_from_dict({"domains": [{"name": "add"}]})
    assert specialist_prefix_of(cfg, "s3://b/run", "add").startswith("s3://b/run/specialist-add-")
    with pytest.raises(ValueError, match=r"domain name '\.\./x'"):
        specialist_prefix_of(cfg, "s3://b/run", "../x")
