"""The embedded engine's device and dtype (engine/device.py): a bfloat16 server on CPU serves generation and
scoring with log-probs close to an HF float32 forward (within `engine_proc.logprob_tolerance`), and bad
--device / --dtype / --mem-fraction-static values are refused with a message before anything loads."""
from __future__ import annotations

import json

import pytest
import torch

from engine_proc import ENGINE_DEVICE, EngineProc, forward_logprobs, http, logprob_tolerance
from engine.launcher import log_tail

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bf16_server(tiny_model_dir, tmp_path_factory):
    # on CPU (or the device the conformance run asks for: ALLOY_TEST_ENGINE_DEVICE=cuda); --mem-fraction-static is
    # accepted (and ignored on CPU)
    srv = EngineProc(tiny_model_dir, tmp_path_factory.mktemp("engine-bf16") / "server.log", "--device", ENGINE_DEVICE,
                     "--dtype", "bf16", "--mem-fraction-static", "0.5").start()
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()


def post(srv, body) -> dict | list:
    status, raw = http(srv.url, "/generate", json.dumps(body).encode())
    assert status == 200, raw
    return json.loads(raw)


def test_bf16_server_generates_and_scores_close_to_fp32(bf16_server, model):
    status, raw = http(bf16_server.url, "/get_server_info", method="GET")
    info = json.loads(raw)
    assert status == 200 and info["device"].split(":")[0] == ENGINE_DEVICE.split(":")[0] and info["dtype"] == "bfloat16"
    assert info["mem_fraction_static"] == 0.5
    if ENGINE_DEVICE == "cpu":
        assert "cuda_memory_reserved_bytes" not in info
    else:  # a benchmark reads the server's peak GPU memory here
        assert 0 < info["cuda_max_memory_allocated_bytes"] <= info["cuda_memory_reserved_bytes"]
        assert info["cuda_memory_reserved_bytes"] <= 0.5 * info["cuda_total_memory_bytes"]
    assert "engine ready: model" in bf16_server.log_path.read_text() and " in bfloat16" in bf16_server.log_path.read_text()
    prompts = [[1, 20, 21, 22, 23, 24, 25], [1, 50, 51, 52, 53], [1, 7, 8]]
    with torch.no_grad():
        zmax = max(model(input_ids=torch.tensor([p])).logits.abs().max().item() for p in prompts)
    tol = logprob_tolerance("bfloat16", model.config.num_hidden_layers, zmax)
    assert tol < 0.1  # 2 layers, |logits| < 2: about 0.02 (measured errors: about 0.005)
    # scoring: input log-probs and top-k of every prompt position
    outs = post(bf16_server, {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                              "logprob_start_len": 0, "top_logprobs_num": 4})
    for ids, o in zip(prompts, outs):
        lp = forward_logprobs(model, ids)
        got = [e[0] for e in o["meta_info"]["input_token_logprobs"][1:]]
        want = [lp[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
        assert max(abs(a - b) for a, b in zip(got, want)) < tol, (got, want, tol)
        for j, top in enumerate(o["meta_info"]["input_top_logprobs"][1:]):
            ref = torch.topk(lp[j], 4).values
            assert max(abs(e[0] - r) for e, r in zip(top, ref.tolist())) < tol
    # generation, greedy and seeded sampling, in one batch: the chosen tokens' log-probs against the fp32 forward
    sp = {"max_new_tokens": 10, "ignore_eos": True}
    outs = post(bf16_server, {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": 2,
                              "sampling_params": [{**sp, "temperature": 0.0}, {**sp, "temperature": 1.0, "sampling_seed": 3},
                                                  {**sp, "temperature": 0.7, "top_k": 20}]})
    for ids, o, temp in zip(prompts, outs, (1.0, 1.0, 0.7)):
        out = o["output_ids"]
        assert len(out) == 10 and all(0 <= t < 100 for t in out)
        lp = torch.log_softmax(forward_logprobs(model, ids + out)[len(ids) - 1: -1] / (1.0 if temp == 1.0 else temp), -1)
        got = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
        want = [lp[t, tok].item() for t, tok in enumerate(out)]
        # a temperature T < 1 scales the logits (and their error) by 1/T
        assert max(abs(a - b) for a, b in zip(got, want)) < tol / temp, (got, want)
    greedy = outs[0]
    assert all(top[0][1] == tok for top, tok in zip(greedy["meta_info"]["output_top_logprobs"], greedy["output_ids"]))
    # a seeded sample repeats (in the same batch: a neighbour with top-k/top-p switches the batch to the sorted
    # inverse CDF, so a seeded row's tokens depend on its batch; engine/sampling.py)
    again = post(bf16_server, {"input_ids": prompts[1:2] * 2, "sampling_params": {**sp, "temperature": 1.0,
                                                                                   "sampling_seed": 3}})
    assert again[0]["output_ids"] == again[1]["output_ids"]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    from engine.server import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--port", "1", *argv])
    return e.value.code, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_device_cuda_without_cuda_is_refused(capsys):
    for dev in ("cuda", "cuda:0"):
        code, err = run_main(["--device", dev], capsys)
        assert code == 2 and "no CUDA GPU" in err and "--device cpu" in err, err


@pytest.mark.parametrize("argv, words", [
    (["--dtype", "float64"], ["--dtype must be one of", "bfloat16", "'float64'"]),
    (["--device", "gpu"], ["--device must be one of auto | cpu | cuda | cuda:N", "'gpu'"]),
    (["--device", "cuda:x"], ["--device must be one of", "'cuda:x'"]),
    (["--mem-fraction-static", "0"], ["--mem-fraction-static (mem_fraction_static) must be a fraction in (0, 1]"]),
    (["--mem-fraction-static", "1.5"], ["(mem_fraction_static) must be a fraction in (0, 1], got 1.5"]),
])
def test_bad_device_dtype_fraction_are_refused(argv, words, capsys):
    code, err = run_main(argv, capsys)
    assert code == 2 and all(w in err for w in words), err


def test_bf16_server_takes_float32_weights(bf16_server, model, tiny_model_dir):
    """Weight pushes land in the bfloat16 model in its dtype: a float32 weight buffer (as a trainer sends it, in the
    body) and an HF dir from disk; the answers stay close to the float32 forward."""
    from engine.weight_buffer import encode_buffer

    body = encode_buffer(model.state_dict(), "fp32-push")
    status, raw = http(bf16_server.url, "/update_weights_from_buffer", body,
                       headers={"Content-Type": "application/octet-stream"})
    assert status == 200 and json.loads(raw)["success"], raw
    status, raw = http(bf16_server.url, "/update_weights_from_disk", json.dumps(
        {"model_path": str(tiny_model_dir), "weight_version": "disk"}).encode())
    assert status == 200 and json.loads(raw)["success"], raw
    ids = [1, 30, 31, 32, 33]
    o = post(bf16_server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                           "logprob_start_len": 0})
    lp = forward_logprobs(model, ids)
    got = [e[0] for e in o["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(g - lp[j, ids[j + 1]].item()) for j, g in enumerate(got)) < logprob_tolerance("bfloat16", 2, 2.0)
    info = json.loads(http(bf16_server.url, "/get_server_info", method="GET")[1])
    assert info["dtype"] == "bfloat16" and info["weight_version"] == "disk"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_server_past_its_memory_fraction_refuses_to_start(tiny_model_dir, tmp_path):
    """A fraction too small for the model: the server exits 1 and says so, naming mem_fraction_static."""
    srv = EngineProc(tiny_model_dir, tmp_path / "server.log", "--device", "cuda", "--mem-fraction-static", "0.00001")
    srv.start()
    try:
        assert srv.proc.wait(120) == 1
    finally:
        srv.kill()
    text = log_tail(srv.log_path)
    assert "mem_fraction_static 1e-05" in text and "GB" in text, text
