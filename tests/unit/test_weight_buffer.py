"""Weight buffers (engine/weight_buffer.py): the file format round trip, clear errors for truncated or corrupt
buffers, and the in-place copy into a model (names, shapes, partial sets, tied weights, the fused decoder)."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from engine.weight_buffer import (ALIGN, MAGIC, WeightBufferError, copy_into, encode_buffer, read_buffer,
                                        state_bytes, write_buffer)

pytestmark = pytest.mark.unit


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w.fp32": torch.randn(3, 5, generator=g), "w.bf16": torch.randn(7, 2, generator=g).to(torch.bfloat16),
            "w.fp16": torch.randn(4, generator=g).half(), "ids.int64": torch.arange(-5, 6),
            "ids.int32": torch.tensor([[1, 2], [3, 2**31 - 1]], dtype=torch.int32), "flag": torch.tensor([True, False]),
            "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5), "strided": torch.randn(6, 4, generator=g).t()}


def test_round_trip_file_and_bytes(tmp_path):
    src = sample()
    path = tmp_path / "w.buf"
    size = write_buffer(path, src, 12)
    assert path.stat().st_size == size and not list(tmp_path.glob(".*tmp*"))  # renamed into place
    for source in (path, str(path), path.read_bytes(), bytearray(path.read_bytes())):
        version, out = read_buffer(source)
        assert version == "12" and list(out) == list(src)
        for name, t in src.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
    assert encode_buffer(src, 12) == path.read_bytes()
    # every tensor's data starts on a 64-byte boundary of the buffer
    hlen = struct.unpack_from("<Q", path.read_bytes(), 8)[0]
    header = json.loads(path.read_bytes()[16:16 + hlen])
    assert all(e["offset"] % ALIGN == 0 for e in header["tensors"]) and header["version"] == "12"


def test_rewrite_replaces_and_open_mapping_keeps_old_data(tmp_path):
    path = tmp_path / "w.buf"
    write_buffer(path, {"x": torch.ones(1000)}, "a")
    _, old = read_buffer(path)  # mapped
    write_buffer(path, {"x": torch.zeros(1000)}, "b")
    assert torch.equal(old["x"], torch.ones(1000))  # the old file lives on under the mapping
    version, new = read_buffer(path)
    assert version == "b" and torch.equal(new["x"], torch.zeros(1000))


def test_truncated_and_corrupt_buffers_name_the_path(tmp_path):
    path = tmp_path / "w.buf"
    write_buffer(path, sample(), 1)
    raw = path.read_bytes()
    cases = {
        "empty": (b"", "empty file"),
        "short": (raw[:10], "too short"),
        "magic": (b"NOTABUF!" + raw[8:], "bad magic"),
        "header-cut": (raw[:40], "does not fit"),
        "data-cut": (raw[:-100], "truncated"),
        "header-json": (MAGIC + struct.pack("<Q", 5) + b"{oops" + b"\0" * 64, "corrupt header"),
    }
    for name, (data, why) in cases.items():
        bad = tmp_path / f"{name}.buf"
        bad.write_bytes(data)
        with pytest.raises(WeightBufferError) as err:
            read_buffer(bad)
        assert str(bad) in str(err.value) and why in str(err.value), (name, str(err.value))
    with pytest.raises(WeightBufferError, match="body.*truncated"):
        read_buffer(raw[:-100])
    with pytest.raises(FileNotFoundError):
        read_buffer(tmp_path / "missing.buf")
    # a header whose tensor entry lies about its size
    header = {"version": "1", "data_bytes": 64, "tensors": [{"name": "x", "dtype": "float32", "shape": [4, 8],
                                                               "offset": 0, "nbytes": 128}]}
    hb = json.dumps(header).encode()
    pre = MAGIC + struct.pack("<Q", len(hb)) + hb
    pre += b"\0" * (-len(pre) % ALIGN)
    with pytest.raises(WeightBufferError, match="'x'.*does not fit"):
        read_buffer(pre + b"\0" * 64)
    with pytest.raises(ValueError, match="dtype"):
        write_buffer(tmp_path / "c.buf", {"c": torch.zeros(2, dtype=torch.complex64)}, 1)


def test_copy_into_checks_then_copies_in_place():
    from engine.decode import FusedDecoder
    from infra.models import build_model

    model = build_model("nano", vocab_size=100, pad_id=0, bos_id=1, eos_id=2, seed=0).eval()
    other = build_model("nano", vocab_size=100, pad_id=0, bos_id=1, eos_id=2, seed=5).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    fused = FusedDecoder.for_model(model)
    assert fused is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v.to(torch.bfloat16) for k, v in other.state_dict().items() if k != "lm_head.weight"}
    bad_sets = {
        "unknown": ({**new, "model.extra.weight": torch.zeros(1)}, "'model.extra.weight' is not a weight"),
        "shape": ({**new, "model.norm.weight": torch.zeros(3)}, r"'model.norm.weight' has shape \[3\]"),
        "kind": ({**new, "model.norm.weight": torch.zeros(32, dtype=torch.long)}, "'model.norm.weight' has dtype"),
        "partial": ({k: v for k, v in new.items() if "layers.1." not in k}, "partial set"),
    }
    for name, (tensors, why) in bad_sets.items():
        with pytest.raises(ValueError, match=why):
            copy_into(model, tensors, "buf")
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), name  # untouched
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert copy_into(model, new, "buf") == len(new)  # the embeddings cover the tied LM head
    fused.refresh()
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs  # in place
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k].to(torch.bfloat16).float()), k
    # the refreshed fused decoder computes what a fresh one over the new weights does
    ref = FusedDecoder.for_model(model)
    for a, b in zip(fused.layers, ref.layers):
        assert torch.equal(a["qkv"][0], b["qkv"][0]) and torch.equal(a["gate_up"][0], b["gate_up"][0])
    assert state_bytes(model) >= sum(v.numel() * 4 for v in model.state_dict().values())
