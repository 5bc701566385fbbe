"""Secret masking by one function (issue 34, part 6): `infra.secrets.mask_secrets` masks credentials in URLs (user
and password, token-only user info, a password holding '@'), query strings and `name: value` pairs; `is_secret` is the
one rule for key names (MLflow params, secret overrides); `scrubbed_env` drops credentials from the environment of
helper processes, and the `math` verifier's sympy helper runs with it."""
from pathlib import Path

import pytest

from infra.config import is_secret_override
from infra.secrets import REDACTED, is_secret, mask_secrets, scrubbed_env
from infra.tracking import mask_url, redact

pytestmark = pytest.mark.unit

MASKED = [
    # URLs: user:password, token-only user info, '@' inside the password
    ("postgresql://u:pw@h:1/db and s3://b/k", "postgresql://u:***@h:1/db and s3://b/k"),
    ("https://ghp_TOKEN123@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("https://user:p@ss@w0rd@mlflow.example/x", "https://user:***@mlflow.example/x"),
    ("http://u:pw@h", "http://u:***@h"),
    # query strings
    ("https://h/x?token=abc&n=1", "https://h/x?token=***&n=1"),
    ("https://h/x?access_token=a&api_key=b&key=c&sig=d&signature=e&password=f&client_secret=g",
     "https://h/x?access_token=***&api_key=***&key=***&sig=***&signature=***&password=***&client_secret=***"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA&X-Amz-Signature=ff&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
    # headers and key/value pairs
    ("Authorization: Bearer sk-123 more", "Authorization: ***"),
    ('{"Authorization": "Basic dXNlcjpwdw==", "n": 1}', '{"Authorization": "***", "n": 1}'),
    ("curl -H 'Bearer abcdefgh'", "curl -H 'Bearer ***'"),
    ("api_key=sk-1 auth: abc cred=xyz credentials: q hf_token=hf_x", "api_key=*** auth: *** cred=*** credentials: *** "
     "hf_token=***"),
    ('{"password": "hunter2", "name": "a"}', '{"password": "***", "name": "a"}'),
]
KEPT = ["http://127.0.0.1:8000/v1/models", "s3://bucket/prefix/step-1", "max_new_tokens=16 tokenizer=/p/tok",
        "https://h/x?page=2&max_tokens=5", "see http://host, mail a@b.com", "sqlite:////abs/runs/mlflow.db", ""]


@pytest.mark.parametrize("text,masked", MASKED)
def test_credentials_are_masked(text, masked):
    assert mask_secrets(text) == masked
    assert mask_url(text) == masked  # the old name is the same function


@pytest.mark.parametrize("text", KEPT)
def test_plain_text_is_kept(text):
    assert mask_secrets(text) == text


@pytest.mark.parametrize("key", ["engine.api_key", "Authorization", "auth", "x.auth.user", "cred", "credential",
                                 "credentials", "secret", "client_secret", "token", "hf_token", "password",
                                 "db.Password", "api_key", "aws_session_token", "sig", "url.signature", "ssh_key"])
def test_secret_key_names(key):
    assert is_secret(key, "v") and redact({key: "v"}) == {key: REDACTED}
    assert is_secret_override(f"{key}=v")


@pytest.mark.parametrize("key,value", [("eval.max_new_tokens", "16"), ("max_tokens", 5), ("tokenizer", "/p"),
                                       ("budget_tokens", None), ("name", "x"), ("design", "x"), ("signal", "x")])
def test_counts_and_plain_keys_are_not_secrets(key, value):
    assert not is_secret(key, value)


def test_redact_masks_credentials_inside_plain_values():
    assert redact({"teachers.external.add": "https://TOKEN@teacher:1/v1"}) == {
        "teachers.external.add": "https://***@teacher:1/v1"}


def test_scrubbed_env_drops_credentials_and_keeps_what_python_needs():
    env = {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "PYTHONPATH": "/x", "TMPDIR": "/t",
           "VIRTUAL_ENV": "/v", "OMP_NUM_THREADS": "1", "X": "plain",
           "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t", "AWS_REGION": "r",
           "HF_TOKEN": "h", "GITHUB_TOKEN": "g", "MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_TOKEN": "t",
           "MLFLOW_TRACKING_URI": "https://u:p@mlflow", "ALLOY_ENGINE_API_KEY": "k", "OPENAI_API_KEY": "k",
           "PGPASSWORD": "p", "ALLOY_SECRET_OVERRIDES": "[]", "DATABASE_URL": "postgres://u:p@h/db",
           "GOOGLE_APPLICATION_CREDENTIALS": "/c.json", "SSH_AUTH_SOCK": "/s"}
    assert scrubbed_env(env) == {k: env[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR",
                                                     "VIRTUAL_ENV", "OMP_NUM_THREADS", "X")}


def test_the_math_helper_runs_without_credentials(monkeypatch):
    """The sympy helper of the `math` verifier parses model output: it gets `scrubbed_env()`, not the trainer's
    environment (read back from /proc)."""
    from domains import verifiers

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak-me")
    monkeypatch.setenv("HF_TOKEN", "leak-me-too")
    worker = verifiers._MathWorker()
    with worker.lock:
        worker._start()
        try:
            environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes().split(b"\0")
        finally:
            worker._stop()
    names = {e.split(b"=", 1)[0] for e in environ if e}
    assert b"PATH" in names and not names & {b"AWS_SECRET_ACCESS_KEY", b"HF_TOKEN"}
    assert b"leak-me" not in b"\0".join(environ)
