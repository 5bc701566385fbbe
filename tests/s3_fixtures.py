"""S3 for tests: one moto server per session on 127.0.0.1, a fresh bucket per test (this is how s3fs tests itself).

Fixtures:
- `moto_server` (session): a running `MotoS3`; `.endpoint_url`, `.stop()`, `.start()`, `.reset()`, `.create_bucket()`.
- `s3_env` (function): dummy AWS credentials, region and `AWS_ENDPOINT_URL_S3` pointing at the server; returns the
  endpoint URL. Code under test reads these standard variables, as it would in production.
- `s3_bucket` (function, uses s3_env): a new, empty bucket with a unique name; returns "s3://<name>". Unique buckets
  (rather than a global reset) keep tests independent without wiping what another fixture created.

Register them for every test in tests/conftest.py with:

    from s3_fixtures import moto_server, s3_bucket, s3_env  # noqa: F401  (pytest fixtures)

Moto keeps its state in-process, so a `MotoS3` stopped and started again (same port) still has its buckets: that is
how tests simulate an S3 outage.
"""
from __future__ import annotations

import logging
import urllib.request
import uuid

import pytest

REGION = "us-east-1"
DUMMY_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
             "AWS_EC2_METADATA_DISABLED": "true"}
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_REGION", "AWS_CONFIG_FILE",
          "AWS_SHARED_CREDENTIALS_FILE")

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise


class MotoS3:
    """A restartable moto server on a loopback port (port 0 = pick a free one, kept across restarts)."""

    def __init__(self, port: int = 0):
        self.port = port
        self._server = None

    def start(self) -> "MotoS3":
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        """Stop serving AND close the listening socket, so clients see 'connection refused' instead of hanging."""
        if self._server is not None:
            self._server.stop()
            if self._server._server is not None:  # ThreadedMotoServer.stop() leaves the socket bound
                self._server._server.server_close()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION,
            aws_access_key_id=DUMMY_ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=DUMMY_ENV["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (unique name by default) and return its name."""
        name = name or f"alloy-test-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)  # us-east-1: no LocationConstraint
        return name


_SESSION_SERVER: MotoS3 | None = None


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server for the whole session (shared even if several modules import this fixture)."""
    global _SESSION_SERVER
    if _SESSION_SERVER is None or not _SESSION_SERVER.running:
        _SESSION_SERVER = MotoS3().start()
    yield _SESSION_SERVER
    if _SESSION_SERVER is not None:
        _SESSION_SERVER.stop()
        _SESSION_SERVER = None


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """Dummy credentials + endpoint in the standard AWS variables; returns the endpoint URL."""
    return point_env_at(moto_server, monkeypatch)


def point_env_at(server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> str:
    """What `s3_env` does, for a fixture of wider scope (its own `pytest.MonkeyPatch.context()`)."""
    if not server.running:  # a test stopped it without restarting
        server.start()
    for var in _UNSET:
        monkeypatch.delenv(var, raising=False)
    for var, value in DUMMY_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    return server.endpoint_url


@pytest.fixture
def s3_bucket(moto_server, s3_env):
    """A fresh bucket; returns its URL "s3://alloy-test-…"."""
    return f"s3://{moto_server.create_bucket()}"
