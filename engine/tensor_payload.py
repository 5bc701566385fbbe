"""SGLang's `/update_weights_from_tensor` payload, both ends, without sglang: a `ForkingPickler` dump of
`[(name, tensor), ...]`, base64 (what `sglang.srt.utils.MultiprocessingSerializer.serialize(obj, output_str=True)`
makes), and a restricted reader of it for the embedded server.

Writing (`serialize`, the trainer): a `ForkingPickler` whose reducers send
- a CUDA tensor as a CUDA IPC handle (torch's own `reduce_tensor`), with the device written as the GPU's UUID instead
  of this process's ordinal, as SGLang's `monkey_patch_torch_reductions` does (a receiver with another
  CUDA_VISIBLE_DEVICES maps the UUID back to its own ordinal; an SGLang server applies that patch at start-up, so
  it reads these payloads; our reader does the same mapping);
- a CPU tensor as a handle of a named shared-memory file (torch's 'file_system' sharing strategy, forced for these
  payloads whatever the process's global strategy: the default 'file_descriptor' strategy passes an fd through
  `multiprocessing.resource_sharer`, which only a child of the sender can fetch (it checks the process's authkey);
  a named shm file can be opened by any process of the same user on the machine). The data is moved into shared
  memory in place (as `torch.multiprocessing` does) and stays referenced by the sender until the receiver has
  taken it.

Reading (`deserialize`, the server): unpickling runs whatever callables the pickle names, so the payload is read
with a `pickle.Unpickler` whose `find_class` allows only what these payloads need (`ALLOWED`): torch's tensor and
storage rebuild functions, torch's storage and tensor classes, `torch.Size`, `torch.device` and the dtypes. Any other
global (`os.system`, `builtins.eval`, …) raises `PayloadRefused` naming it, before anything of it runs. A CUDA
rebuild is routed to `rebuild_cuda_tensor` here, which accepts the device as an ordinal or a UUID (whoever's module
the payload names for it: torch's, or SGLang's patched `_rebuild_cuda_tensor_modified`). The fd strategy's rebuild
(`rebuild_storage_fd`) is refused: it connects to a socket the payload names.

What the allow-list still trusts the caller with (the endpoint is behind the API key, like /update_weights_from_disk,
which loads any path): a CUDA IPC handle or a shm file name of the caller's choosing is opened by the server.
Read (not copied) from sgl-project/sglang `python/sglang/srt/utils` (MultiprocessingSerializer, patch_torch).
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reducers with ForkingPickler
from torch.multiprocessing import reductions

DEVICE_ARG = 6  # rebuild_cuda_tensor's `storage_device` argument (stable across torch versions for years)


class PayloadRefused(ValueError):
    """A tensor payload that is not one: bad base64, a global outside `ALLOWED`, not a list of (name, tensor)."""


# -- the device as a UUID (CUDA IPC across processes with different CUDA_VISIBLE_DEVICES) ---------------------------

def _device_to_uuid(device) -> str | int:
    return str(torch.cuda.get_device_properties(device).uuid) if isinstance(device, int) else device


def _device_from_uuid(device) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == device:
                return i
        raise PayloadRefused(f"CUDA device {device} (a UUID) is not visible to this process")
    raise PayloadRefused(f"CUDA device {device!r}: neither an ordinal nor a UUID")


def rebuild_cuda_tensor(*args):
    """torch's `rebuild_cuda_tensor` with its device argument as an ordinal or a GPU UUID."""
    args = list(args)
    args[DEVICE_ARG] = _device_from_uuid(args[DEVICE_ARG])
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(*args)


# -- writing ------------------------------------------------------------------------------------------------------

def _reduce_tensor(t: torch.Tensor):
    if t.requires_grad and not t.is_leaf:
        t = t.detach()
    if t.is_cuda:
        original = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
        _fn, args = original(t)
        args = list(args)
        args[DEVICE_ARG] = _device_to_uuid(args[DEVICE_ARG])
        return reductions.rebuild_cuda_tensor, tuple(args)
    if t.device.type != "cpu":
        raise PayloadRefused(f"cannot send a tensor on {t.device} (CUDA or CPU only)")
    meta = (t.storage_offset(), t.size(), t.stride(), t.requires_grad)
    return reductions.rebuild_tensor, (type(t), t._typed_storage(), meta)


def _reduce_storage(storage: torch.UntypedStorage):
    """A CPU storage as a named shm file (torch's 'file_system' strategy, whatever the global one is)."""
    if storage.device.type != "cpu":
        raise PayloadRefused(f"cannot send a {storage.device} storage on its own")
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference (torch's own protocol)
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _Pickler(ForkingPickler):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        table = dict(self.dispatch_table)
        for cls in (torch.Tensor, torch.nn.Parameter, *torch._tensor_classes):
            table[cls] = _reduce_tensor
        table[torch.UntypedStorage] = _reduce_storage
        self.dispatch_table = table


def serialize(obj, output_str: bool = True):
    """`obj` (e.g. [(name, tensor), ...]) as SGLang's MultiprocessingSerializer writes it: a ForkingPickler dump,
    base64 text when `output_str`. The tensors must stay alive (referenced by the caller) until the receiver has
    read them."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


class Serializer:
    """`serialize` with the interface of SGLang's `MultiprocessingSerializer` (engine/sglang_sync.py takes either)."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        return serialize(obj, output_str)

    @staticmethod
    def deserialize(data):
        return deserialize(data)


# -- reading ------------------------------------------------------------------------------------------------------

_R = "torch.multiprocessing.reductions"
ALLOWED: dict[tuple[str, str], object] = {
    (_R, "rebuild_tensor"): reductions.rebuild_tensor,
    (_R, "rebuild_cuda_tensor"): rebuild_cuda_tensor,
    (_R, "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    (_R, "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    (_R, "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    (_R, "rebuild_typed_storage_child"): reductions.rebuild_typed_storage_child,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
}
for _cls in torch._storage_classes:
    ALLOWED[("torch", _cls.__name__)] = _cls
for _name in dir(torch):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        ALLOWED[("torch", _name)] = getattr(torch, _name)
# SGLang's patched CUDA rebuild (sglang.srt.utils.patch_torch / sglang.srt.patch_torch): read by our own
CUDA_REBUILD_ALIASES = frozenset({"_rebuild_cuda_tensor_modified"})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith("sglang.") and name in CUDA_REBUILD_ALIASES:
            return rebuild_cuda_tensor
        found = ALLOWED.get((module, name))
        if found is None:
            raise PayloadRefused(f"refused global {module}.{name}: not a tensor rebuild function or class of the "
                                 "weight-payload allow-list (engine/tensor_payload.py)")
        return found

    def persistent_load(self, pid):
        raise PayloadRefused("refused a persistent id (not a ForkingPickler tensor payload)")


def deserialize(data: str | bytes):
    """The object of a `serialize` payload (base64 text or bytes), read with the allow-list; `PayloadRefused`
    naming the first refused global (nothing of it has run)."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise PayloadRefused(f"not base64: {e}") from None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except PayloadRefused:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise PayloadRefused(f"not a tensor payload ({type(e).__name__}: {e})") from None


def named_tensors(obj, where: str = "serialized_named_tensors") -> dict[str, torch.Tensor]:
    """{name: tensor} of a deserialized payload: a list (or tuple) of (str, tensor) pairs, each name once."""
    if not isinstance(obj, (list, tuple)):
        raise PayloadRefused(f"{where}: a list of (name, tensor) pairs expected, got {type(obj).__name__}")
    out: dict[str, torch.Tensor] = {}
    for item in obj:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise PayloadRefused(f"{where}: every entry must be a (name, tensor) pair, got {str(item)[:100]!r}")
        if item[0] in out:
            raise PayloadRefused(f"{where}: tensor {item[0]!r} appears twice")
        out[item[0]] = item[1]
    return out

