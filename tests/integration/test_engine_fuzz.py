"""Property test: malformed requests never make the embedded engine server answer 5xx or die.

Random JSON values in every /generate field (and in the known sampling params), wrong types, garbage bytes, and
random bodies for the control endpoints: the status is 200 or 4xx (4xx with `{"error": ...}`), and /health stays 200.
The server runs with a small token budget (--max-total-tokens) so a body that happens to be valid stays cheap.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_proc import EngineProc, http
from engine.launcher import log_tail

pytestmark = pytest.mark.integration

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])


def request(base: str, path: str, data: bytes | None, method: str = "POST") -> tuple[int, bytes]:
    return http(base, path, data, method=method)


@pytest.fixture(scope="module")
def url(tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("engine-fuzz") / "server.log"
    srv = EngineProc(tiny_model_dir, log_path, "--max-total-tokens", "1024", "--max-body-mb", "1").start()
    try:
        srv.wait_healthy()
        yield srv.url
        assert srv.alive(), f"server died; log:\n{log_tail(log_path)}"
        assert "Traceback" not in log_path.read_text(errors="replace"), log_tail(log_path, 60)
    finally:
        srv.kill()


def check(base: str, status: int, payload: bytes) -> None:
    event(f"status {status}")
    assert status == 200 or 400 <= status < 500, (status, payload[:300])
    if status >= 400 and status != 404 and status != 405:
        body = json.loads(payload)
        # a failed weight update answers 400 with SGLang's `{success: false, message}`; every other 4xx is an error
        assert "error" in body or (body.get("success") is False and body["message"]), payload[:300]
    assert request(base, "/health", None, "GET")[0] == 200


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
token_ids = st.lists(st.integers(-2, 102), min_size=0, max_size=12)
SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "n",
            "skip_special_tokens", "no_stop_trim", "sampling_seed", "min_p", "repetition_penalty", "regex", "zzz"]
sampling_values = {
    "max_new_tokens": st.one_of(st.integers(-2, 8), json_values), "n": st.one_of(st.integers(-1, 3), json_values),
    "temperature": st.one_of(st.floats(-1, 2), json_values), "top_k": st.one_of(st.integers(-2, 5), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_values), "stop_token_ids": st.one_of(token_ids, json_values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), json_values),
}
sampling_params = st.dictionaries(st.sampled_from(SAMPLING),
                                  st.deferred(lambda: st.one_of(json_values, st.integers(0, 4))), max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({k: sampling_values.get(k, json_values) for k in d}))
FIELDS = {
    "text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3), json_values),
    "input_ids": st.one_of(token_ids, st.lists(token_ids, max_size=3), json_values),
    "sampling_params": st.one_of(sampling_params, st.lists(sampling_params, max_size=3), json_values),
    "return_logprob": st.one_of(st.booleans(), json_values),
    "logprob_start_len": st.one_of(st.integers(-2, 14), st.lists(st.integers(-2, 14), max_size=3), json_values),
    "top_logprobs_num": st.one_of(st.integers(-1, 120), json_values),
    "token_ids_logprob": st.one_of(token_ids, st.lists(token_ids, max_size=3), json_values),
    "return_text_in_logprobs": st.one_of(st.booleans(), json_values),
    "rid": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=4), max_size=3), json_values),
    "stream": st.one_of(st.just(False), json_values),
    "image_data": json_values, "return_hidden_states": json_values, "unknown_field": json_values,
}
valid_ids = st.lists(st.integers(1, 99), min_size=1, max_size=10)


def _mutate(ids, field, value, sp_key, sp_value, in_sampling):
    """A valid cheap request with exactly one field (top-level or sampling param) set to a random value."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    if in_sampling:
        body["sampling_params"][sp_key] = sp_value
    else:
        body[field] = value
    return body


one_bad_field = st.builds(_mutate, valid_ids, st.sampled_from(sorted(FIELDS)), json_values, st.sampled_from(SAMPLING),
                          json_values, st.booleans())
generate_bodies = st.one_of(
    one_bad_field,
    st.fixed_dictionaries({}, optional=FIELDS),
    st.fixed_dictionaries({"input_ids": token_ids}, optional={k: v for k, v in FIELDS.items() if k != "input_ids"}),
    json_values,
)


@settings(FUZZ, max_examples=600)
@given(body=generate_bodies)
def test_generate_never_5xx(url, body):
    data = json.dumps(body).encode()  # NaN/Infinity become the non-standard tokens Python's json accepts
    check(url, *request(url, "/generate", data))


@settings(FUZZ, max_examples=100)
@given(data=st.one_of(st.binary(max_size=200), st.text(max_size=100).map(str.encode)))
def test_garbage_bytes_never_5xx(url, data):
    for path in ("/generate", "/abort_request", "/update_weights_from_disk"):
        check(url, *request(url, path, data))


CONTROL_FIELDS = {"rid": json_values, "abort_all": st.one_of(st.booleans(), json_values),
                  "model_path": st.one_of(st.sampled_from(["", "/nonexistent/model", "/tmp", "."]), json_values),
                  "weight_version": json_values, "flush_cache": json_values, "abort_all_requests": json_values}


@settings(FUZZ, max_examples=200)
@given(path=st.sampled_from(["/abort_request", "/update_weights_from_disk", "/flush_cache", "/get_model_info",
                             "/get_server_info", "/health_generate"]),
       body=st.one_of(st.fixed_dictionaries({}, optional=CONTROL_FIELDS), json_values),
       method=st.sampled_from(["POST", "GET", "PUT"]))
def test_control_endpoints_never_5xx(url, path, body, method):
    check(url, *request(url, path, json.dumps(body).encode(), method))
