"""`alloy teachers up | status | down`: detached teacher engine servers a pipeline can use as `teachers.external`.
Real servers (the tiny model) on free loopback ports; `--checkpoints` in each of its forms."""
from __future__ import annotations

import json
import re
import shutil
import urllib.request

import psutil
import pytest

from alloy.teachers_stack import CheckpointsError, resolve_checkpoints
from e2e_helpers import run_cli

pytestmark = pytest.mark.e2e


def test_checkpoints_forms(tmp_path, tiny_model_dir):
    """A run dir (what the pipeline commits), a report.json, inline JSON and a dir of <domain>/ checkpoints."""
    run = tmp_path / "run"
    for dom in ("reverse", "max_list"):
        shutil.copytree(tiny_model_dir, run / f"specialist-{dom}-0123abcd" / "final")
    (run / "base-0123abcd" / "step-00000020").mkdir(parents=True)  # not a specialist: ignored
    want = {d: str((run / f"specialist-{d}-0123abcd" / "final").resolve()) for d in ("reverse", "max_list")}
    assert resolve_checkpoints(str(run)) == want
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"artifacts": {"specialists": {
        d: f"file://{run}/specialist-{d}-0123abcd/final" for d in want}}}))
    assert resolve_checkpoints(str(report)) == want
    assert resolve_checkpoints(json.dumps({"copy": str(run / "specialist-reverse-0123abcd")})) == {"copy": want["reverse"]}
    flat = tmp_path / "flat"
    shutil.copytree(tiny_model_dir, flat / "caesar")
    assert resolve_checkpoints(str(flat)) == {"caesar": str((flat / "caesar").resolve())}
    with pytest.raises(CheckpointsError, match="domain 'x'.*not an HF checkpoint"):
        resolve_checkpoints(json.dumps({"x": str(tmp_path)}))
    with pytest.raises(CheckpointsError, match="is one checkpoint; name its domain"):
        resolve_checkpoints(str(flat / "caesar"))


def test_teachers_up_status_down(tmp_path, tiny_model_dir):
    home = str(tmp_path / "home")
    ckpts = json.dumps({"reverse": str(tiny_model_dir), "copy": str(tiny_model_dir)})
    up = run_cli("teachers", "up", "--checkpoints", ckpts, "--port-start", "0", "--home", home, timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    urls = dict(re.findall(r"--set teachers\.external\.(\w+)=(http://127\.0\.0\.1:\d+)", up.stdout))
    assert set(urls) == {"reverse", "copy"} and len(set(urls.values())) == 2

    # each one is a working SGLang-protocol server: greedy generate and a scoring call
    body = {"text": "rev:ab=", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, "return_logprob": True}
    req = urllib.request.Request(urls["reverse"] + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= 3
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])

    status = run_cli("teachers", "status", "--home", home, timeout=60)
    assert status.returncode == 0, status.stdout
    rows = {ln.split()[0]: ln.split() for ln in status.stdout.splitlines()[1:]}
    assert {d: (r[1], r[3]) for d, r in rows.items()} == {d: ("healthy", u) for d, u in urls.items()}

    again = run_cli("teachers", "up", "--checkpoints", ckpts, "--port-start", "0", "--home", home, timeout=60)
    assert again.returncode == 0 and "teachers already up" in again.stdout
    other = run_cli("teachers", "up", "--checkpoints", json.dumps({"copy": str(tiny_model_dir)}), "--home", home,
                    timeout=60)
    assert other.returncode == 1 and "teachers already running" in other.stderr

    pids = [int(r[2]) for r in rows.values()]
    down = run_cli("teachers", "down", "--home", home, timeout=60)
    assert down.returncode == 0 and down.stdout.strip() == "stopped: copy, reverse"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    gone = run_cli("teachers", "status", "--home", home, timeout=60)
    assert gone.returncode == 1 and "no teachers" in gone.stdout


def test_teachers_bad_input_exit_codes(tmp_path):
    bad = run_cli("teachers", "up", "--checkpoints", str(tmp_path / "missing"), "--home", str(tmp_path), timeout=60)
    assert bad.returncode == 2 and "neither a directory, a JSON file nor inline JSON" in bad.stderr
    usage = run_cli("teachers", timeout=60)
    assert usage.returncode == 2 and "required: {up,down,status}" in usage.stderr
