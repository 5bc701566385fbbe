"""The embedded engine on its device: one server on a fresh `small` model, checked against HF on the same device.

    python bench/engine_cuda_check.py --out /path/engine_cuda_check.json [--device auto] [--dtype auto]
        [--concurrency 16] [--new-tokens 64]

Starts `python -m engine.server --device auto` (CUDA in bfloat16 when torch sees a GPU, else CPU in float32) on a
model written by `infra.models.init_model_dir("small", ...)` (seed 0), loads the same model in-process on the
server's device and dtype (`hf`) and in float32 (`ref`), and checks:

- `server_info`: /get_server_info names the device and dtype asked for (auto resolved), and on CUDA the peak and
  reserved memory of the server process.
- `greedy_matches_hf`: greedy /generate of a few prompts (in one batch) against `hf.generate(do_sample=False)`.
  In bfloat16 exact equality can fail on a near-tie (the engine's fused q/k/v and gate/up matmuls round
  differently from HF's separate ones): a prompt passes if its tokens are equal, or if at the first difference
  the two tokens' logits under `hf` (teacher-forced on the engine's prefix) are within the bf16 logit tolerance
  (an explained tie); `exact` counts the prompts with equal tokens.
- `output_logprobs_close`, `scoring_close`: the greedy tokens' log-probs, and scoring answers (input log-probs,
  top-5), against a float32 forward within `engine.device.logprob_tolerance` for the server's dtype.
- `seeded_sampling`: a batch of seeded requests sent twice returns the same tokens; unseeded ones valid ids.
- `concurrent`: `--concurrency` requests at once (mixed greedy / sampled, different prompt lengths) all complete
  with the asked number of tokens.
- `decode_throughput`: tokens/s of those concurrent requests (completion tokens / wall time), and of one stream.

Writes the JSON (`ok` per check, top-level `ok`) and exits 1 if any check failed. On CPU it takes under a minute.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, add_check, start_meta, write_json  # noqa: E402  (puts the repository on sys.path)


def call(url: str, path: str, body=None, timeout: float = 300.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(model_dir: Path, port: int, device: str, dtype: str, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine.server", "--model", str(model_dir), "--port", str(port),
           "--device", device, "--dtype", dtype, "--max-running-requests", "64"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()[-3000:]}")


def prompts(n: int, seed: int, lo: int = 4, hi: int = 24) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, 100, (k - 1,), generator=g).tolist() for k in lens]


class Checks:
    def __init__(self):
        self.results: dict[str, dict] = {}

    def run(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - recorded as a failed check
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.perf_counter() - t0, 3)
        self.results[name] = res
        print(f"{name}: {'ok' if res.get('ok') else 'FAILED'} {json.dumps({k: v for k, v in res.items() if k != 'traceback'})[:400]}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    add_check(p, "any check fails", always=True)
    args = p.parse_args(argv)
    meta = start_meta()

    import torch

    from engine.device import dtype_name, logprob_tolerance, resolve_device, resolve_dtype
    from engine.launcher import free_port
    from infra.models import init_model_dir, load_model

    t_start = time.perf_counter()
    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, dev)
    out: dict = {"bench": "engine_cuda_check", "meta": meta, "device": str(dev), "dtype": dtype_name(dt),
                 "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="engine-cuda-check-") as tmp:
        model_dir = init_model_dir("small", Path(tmp) / "small", seed=0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        proc = start_server(model_dir, port, args.device, args.dtype, log_path)
        try:
            t0 = time.perf_counter()
            wait_healthy(url, proc, log_path)
            out["server_start_s"] = round(time.perf_counter() - t0, 2)
            hf = load_model(model_dir, dtype=dt, device=dev)
            ref = load_model(model_dir, dtype=torch.float32, device=dev)
            layers = ref.config.num_hidden_layers

            def fp32_logprobs(ids: list[int]) -> torch.Tensor:
                with torch.inference_mode():
                    return torch.log_softmax(ref(input_ids=torch.tensor([ids], device=dev)).logits[0].float(), -1).cpu()

            def tolerance(seqs: list[list[int]]) -> float:
                with torch.inference_mode():
                    zmax = max(ref(input_ids=torch.tensor([s], device=dev)).logits.abs().max().item() for s in seqs)
                return logprob_tolerance(dtype_name(dt), layers, zmax)

            def server_info():
                info = call(url, "/get_server_info")
                res = {k: info.get(k) for k in ("device", "dtype", "mem_fraction_static", "cuda_max_memory_allocated_bytes",
                                                "cuda_memory_reserved_bytes", "cuda_total_memory_bytes")}
                ok = torch.device(info["device"]).type == dev.type and info["dtype"] == dtype_name(dt)
                if dev.type == "cuda":
                    ok = ok and info.get("cuda_max_memory_allocated_bytes", 0) > 0
                return {"ok": ok, **res}

            greedy_prompts = prompts(6, seed=1)
            n_greedy = 16

            def greedy():
                outs = call(url, "/generate", {"input_ids": greedy_prompts, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": n_greedy, "temperature": 0.0,
                                                                   "ignore_eos": True}})
                tol_z = tolerance(greedy_prompts) / 2  # the logit tolerance (log-prob tolerance = 2 × logit)
                exact, ties, bad = 0, [], []
                for i, (pr, o) in enumerate(zip(greedy_prompts, outs)):
                    with torch.inference_mode():
                        want = hf.generate(torch.tensor([pr], device=dev), attention_mask=torch.ones((1, len(pr)), dtype=torch.long, device=dev),
                                           max_new_tokens=n_greedy, min_new_tokens=n_greedy, do_sample=False,
                                           pad_token_id=0)[0, len(pr):].tolist()
                    got = o["output_ids"]
                    if got == want:
                        exact += 1
                        continue
                    t = next(j for j in range(n_greedy) if got[j] != want[j])
                    with torch.inference_mode():
                        z = hf(input_ids=torch.tensor([pr + got[:t]], device=dev)).logits[0, -1].float()
                    gap = abs(z[got[t]].item() - z[want[t]].item())
                    (ties if gap <= tol_z else bad).append({"prompt": i, "position": t, "logit_gap": gap})
                greedy.outs = outs
                return {"ok": not bad, "prompts": len(greedy_prompts), "exact": exact, "explained_ties": ties,
                        "unexplained": bad, "logit_tolerance": tol_z}

            def output_logprobs():
                worst, tol = 0.0, tolerance(greedy_prompts)
                for pr, o in zip(greedy_prompts, greedy.outs):
                    lp = fp32_logprobs(pr + o["output_ids"])
                    for t, (v, tok, _) in enumerate(o["meta_info"]["output_token_logprobs"]):
                        worst = max(worst, abs(v - lp[len(pr) - 1 + t, tok].item()))
                return {"ok": worst < tol, "max_abs_diff": worst, "tolerance": tol}

            def scoring():
                seqs = prompts(8, seed=2, lo=8, hi=40)
                outs = call(url, "/generate", {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0},
                                               "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5})
                worst, top_worst, tol = 0.0, 0.0, tolerance(seqs)
                for ids, o in zip(seqs, outs):
                    lp = fp32_logprobs(ids)
                    m = o["meta_info"]
                    for j in range(1, len(ids)):
                        worst = max(worst, abs(m["input_token_logprobs"][j][0] - lp[j - 1, ids[j]].item()))
                        ref_top = torch.topk(lp[j - 1], 5).values.tolist()
                        top_worst = max(top_worst, max(abs(e[0] - r) for e, r in zip(m["input_top_logprobs"][j], ref_top)))
                return {"ok": worst < tol and top_worst < tol, "max_abs_diff": worst, "top5_max_abs_diff": top_worst,
                        "tolerance": tol, "sequences": len(seqs)}

            def seeded():
                body = {"input_ids": prompts(4, seed=3), "sampling_params": [
                    {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 100 + i, "ignore_eos": True}
                    for i in range(4)]}
                a, b = call(url, "/generate", body), call(url, "/generate", body)
                free = call(url, "/generate", {"input_ids": prompts(4, seed=4), "sampling_params": {
                    "max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "ignore_eos": True}})
                same = [x["output_ids"] == y["output_ids"] for x, y in zip(a, b)]
                valid = all(len(o["output_ids"]) == 24 and all(0 <= t < 100 for t in o["output_ids"]) for o in free)
                return {"ok": all(same) and valid, "seeded_repeat": same, "unseeded_valid": valid}

            def one(i: int, pr: list[int]) -> int:
                sp = {"max_new_tokens": args.new_tokens, "ignore_eos": True,
                      "temperature": 0.0 if i % 2 == 0 else 1.0}
                o = call(url, "/generate", {"input_ids": pr, "sampling_params": sp, "rid": f"c{i}"})
                return len(o["output_ids"])

            def concurrent_run():
                prs = prompts(args.concurrency, seed=5)
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
                    lens = list(ex.map(one, range(len(prs)), prs))
                wall = time.perf_counter() - t0
                concurrent_run.tps = sum(lens) / wall
                return {"ok": all(n == args.new_tokens for n in lens), "requests": len(prs), "wall_s": round(wall, 3)}

            def throughput():
                t0 = time.perf_counter()
                n = one(0, prompts(1, seed=6)[0])
                single = n / (time.perf_counter() - t0)
                tps = getattr(concurrent_run, "tps", None)
                return {"ok": tps is not None and tps > 0, "concurrent_tokens_per_s": round(tps or 0, 1),
                        "concurrency": args.concurrency, "single_stream_tokens_per_s": round(single, 1),
                        "new_tokens": args.new_tokens}

            checks.run("server_info", server_info)
            checks.run("greedy_matches_hf", greedy)
            checks.run("output_logprobs_close", output_logprobs if hasattr(greedy, "outs") else
                       (lambda: {"ok": False, "error": "no greedy outputs"}))
            checks.run("scoring_close", scoring)
            checks.run("seeded_sampling", seeded)
            checks.run("concurrent", concurrent_run)
            checks.run("decode_throughput", throughput)
            checks.run("server_info_after", server_info)  # peak memory after the load
        except Exception as e:  # noqa: BLE001 - the server did not start: one failed check
            checks.results["server"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            out["server_log_tail"] = log_path.read_text()[-1500:] if log_path.exists() else ""
    out["checks"] = checks.results
    out["ok"] = bool(checks.results) and all(c.get("ok") for c in checks.results.values())
    out["total_s"] = round(time.perf_counter() - t_start, 2)
    write_json(Path(args.out), out)
    print(f"ok={out['ok']} ({out['total_s']}s) → {args.out}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
