"""A weight buffer: one file (or one HTTP body) holding a set of named tensors and a weight version, for pushing a
trainer's weights into an embedded engine server without safetensors/`from_pretrained` (docs/architecture.md,
"The engine protocol").

Layout (all integers little-endian):

    offset 0   8 bytes   MAGIC (b"ALLOYWB1")
    offset 8   8 bytes   header length H (uint64)
    offset 16  H bytes   JSON header {"version": str, "data_bytes": int,
                                      "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, …]}
    then zero padding to the next multiple of 64 (the data start D)
    D …        the tensors' raw little-endian bytes, each at D + offset, offsets multiples of 64

`dtype` is a torch dtype name without the `torch.` prefix (float32, bfloat16, int64, …). No pickle anywhere: a
reader maps the bytes (`mmap` of the file, or the body itself) and views each tensor on them with
`torch.frombuffer`, so reading costs no copy until the engine copies the tensors into its parameters.

`write_buffer` writes a temporary file beside `path` and renames it over `path`, so a reader sees the old buffer
or the new one, never half of one.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import sys
import warnings
from pathlib import Path
from typing import Iterable, Mapping

import torch

MAGIC = b"ALLOYWB1"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")  # magic, header length
MAX_HEADER_BYTES = 256 * 2**20
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}
_NAMES = {v: k for k, v in DTYPES.items()}


class WeightBufferError(ValueError):
    """A buffer that cannot be read (truncated, corrupt, not a weight buffer); the message names its source."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("weight buffers hold little-endian data; this machine is big-endian")


def plan_buffer(named_tensors: Iterable[tuple[str, torch.Tensor]], version) -> tuple[bytes, list[torch.Tensor], int]:
    """(the prefix: magic + header length + header + padding, the tensors in order (contiguous, on CPU), total
    size in bytes) of a buffer holding `named_tensors` as `version`."""
    _check_byteorder()
    entries, tensors, offset, seen = [], [], 0, set()
    for name, t in named_tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"weight buffer: tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"weight buffer: tensor {name!r} appears twice")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight buffer: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _NAMES:
            raise ValueError(f"weight buffer: tensor {name!r} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape), "offset": offset,
                        "nbytes": nbytes})
        tensors.append(t)
        offset = _align(offset + nbytes)
    header = json.dumps({"version": str(version), "data_bytes": offset, "tensors": entries},
                        separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, len(header)) + header
    prefix += b"\0" * (_align(len(prefix)) - len(prefix))
    return prefix, tensors, len(prefix) + offset


def _write_to(f, prefix: bytes, tensors: list[torch.Tensor]) -> None:
    f.write(prefix)
    written = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        pad = _align(written + n) - (written + n)
        if pad:
            f.write(b"\0" * pad)
        written += n + pad


def write_buffer(path: str | Path, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 version) -> int:
    """Write `named_tensors` (a mapping or (name, tensor) pairs; any device, any layout) and `version` to `path`
    (temporary file + rename: readers never see half a buffer). Returns the buffer's size in bytes."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    prefix, tensors, size = plan_buffer(items, version)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            _write_to(f, prefix, tensors)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def encode_buffer(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version) -> bytes:
    """The buffer as bytes (an HTTP body for a server on another machine)."""
    import io

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    prefix, tensors, size = plan_buffer(items, version)
    out = io.BytesIO()
    _write_to(out, prefix, tensors)
    return out.getvalue()


def _parse_header(buf, where: str) -> tuple[str, list[dict], int]:
    size = len(buf)
    if size < _PREFIX.size:
        raise WeightBufferError(f"weight buffer {where}: {size} bytes, too short for a header (truncated?)")
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WeightBufferError(f"weight buffer {where}: bad magic (its first 8 bytes are not {MAGIC!r}); "
                                "not a weight buffer")  # never echo the bytes: the file may be anything
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > size:
        raise WeightBufferError(f"weight buffer {where}: header of {hlen} bytes does not fit in {size} bytes "
                                "(truncated or corrupt)")
    try:
        header = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + hlen]))
        version, entries, data_bytes = str(header["version"]), header["tensors"], int(header["data_bytes"])
    except (ValueError, KeyError, TypeError) as e:  # the error's type only: its text may quote the header
        raise WeightBufferError(f"weight buffer {where}: corrupt header ({type(e).__name__})") from None
    start = _align(_PREFIX.size + hlen)
    if start + data_bytes > size:
        raise WeightBufferError(f"weight buffer {where}: {size} bytes, but its header promises {start + data_bytes} "
                                "(truncated)")
    if not isinstance(entries, list):
        raise WeightBufferError(f"weight buffer {where}: corrupt header ('tensors' is not a list)")
    return version, entries, start


def _views(buf, entries: list[dict], start: int, where: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    size = len(buf)
    with warnings.catch_warnings():  # a read-only buffer (bytes): the views are only ever read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for e in entries:
            try:
                name, dtype, shape = e["name"], DTYPES[e["dtype"]], [int(d) for d in e["shape"]]
                offset, nbytes = int(e["offset"]), int(e["nbytes"])
            except (KeyError, TypeError, ValueError) as err:
                raise WeightBufferError(f"weight buffer {where}: corrupt tensor entry {e!r} ({err})") from None
            numel = 1
            for d in shape:
                if d < 0:
                    raise WeightBufferError(f"weight buffer {where}: tensor {name!r} has a negative dimension {shape}")
                numel *= d
            itemsize = torch.empty((), dtype=dtype).element_size()
            if numel * itemsize != nbytes or offset < 0 or offset % ALIGN or start + offset + nbytes > size:
                raise WeightBufferError(f"weight buffer {where}: tensor {name!r} ({e['dtype']} {shape}, {nbytes} bytes "
                                        f"at {offset}) does not fit the buffer of {size} bytes (corrupt or truncated)")
            if name in out:
                raise WeightBufferError(f"weight buffer {where}: tensor {name!r} appears twice")
            if numel == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=start + offset).view(shape)
    return out


def read_buffer(source: str | Path | bytes | bytearray | memoryview) -> tuple[str, dict[str, torch.Tensor]]:
    """(version, {name: tensor}) of a buffer file (`str`/`Path`: memory-mapped, copy-on-write) or of its bytes.
    The tensors are views on the mapping / the bytes (no copy). Raises `WeightBufferError` naming the source for a
    truncated or corrupt buffer, FileNotFoundError for a missing file."""
    _check_byteorder()
    if isinstance(source, (str, Path)):
        where = str(source)
        # non-blocking: opening a FIFO for reading would wait for a writer (a hung thread); anything but a regular
        # file is refused on the open file itself, so a path swapped after a caller's check cannot slip through
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise WeightBufferError(f"weight buffer {where}: not a regular file")
            size = st.st_size
            if size == 0:
                raise WeightBufferError(f"weight buffer {where}: empty file")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private + writable: frombuffer without warnings
    else:
        where, buf = f"(a {len(source)}-byte body)", source
    version, entries, start = _parse_header(buf, where)
    return version, _views(buf, entries, start, where)


def state_bytes(model: torch.nn.Module, float_bytes: int = 0) -> int:
    """Bytes of a buffer holding every entry of `model.state_dict()` in its own dtype (tied names counted each
    time), plus its header: the largest buffer a server for `model` needs to accept. `float_bytes`: floating-point
    entries count at least this many bytes each (4: a bfloat16 server still takes a trainer's float32 buffer)."""
    sd = model.state_dict()
    data = sum(_align(t.numel() * (max(t.element_size(), float_bytes) if t.is_floating_point() else t.element_size()))
               for t in sd.values())
    header = _align(_PREFIX.size + 64 * 2**10 + 256 * len(sd) + sum(len(k) for k in sd))
    return header + data


def copy_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], where: str = "the buffer", *,
              complete: bool = True) -> int:
    """Copy `tensors` (HF state-dict names) into `model`'s parameters and buffers in place (`param.data.copy_`),
    casting to each parameter's dtype. Everything is checked before anything is copied, so a refused set leaves
    the model as it was: every name must be one of the model's state-dict names, with the same shape and the
    same kind (floating point or not), and the set must cover every parameter. Tied parameters (an LM head tied
    to the input embeddings) are one tensor under two names: either name covers both. Returns the number of
    tensors copied; raises ValueError naming the first offending tensor. `complete=False` accepts a subset (SGLang's
    update endpoints take a push split over several requests); every other check stays."""
    sd = model.state_dict(keep_vars=True)
    for name, t in tensors.items():
        if name not in sd:
            raise ValueError(f"{where}: tensor {name!r} is not a weight of the model "
                             f"(e.g. {sorted(sd)[:3]} …, {len(sd)} names)")
        dst = sd[name]
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {list(t.shape)}, the model's {list(dst.shape)}")
        if t.dtype.is_floating_point != dst.dtype.is_floating_point:
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype}, the model's {dst.dtype}")
    covered = {sd[n].data_ptr() for n in tensors}
    missing = [n for n, p in model.named_parameters() if p.numel() and p.data_ptr() not in covered]
    if missing and complete:
        raise ValueError(f"{where}: a partial set of weights ({len(tensors)} tensors): missing {len(missing)} "
                         f"parameter(s) of the model, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, t in tensors.items():
            sd[name].data.copy_(t)
    for dev in {sd[n].device for n in tensors} | {t.device for t in tensors.values()}:
        if dev.type == "cuda":  # the sources may be another process's memory (CUDA IPC): copied before answering
            torch.cuda.synchronize(dev)
    return len(tensors)
