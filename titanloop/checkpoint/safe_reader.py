"""Loading a DCP checkpoint without executing anything it contains: the one way titanloop reads DCP.

DCP pickles two things, and a pickle can run arbitrary code when loaded:
- the `.metadata` file: read here by an unpickler that only builds the classes a DCP metadata file consists
  of (dataclasses from torch.distributed.checkpoint, torch.Size, dtypes/layouts, paths);
- non-tensor entries (python values saved with `torch.save`): DCP's default planner reads them with
  `torch.load(weights_only=False)`; SafeLoadPlanner reads them with `weights_only=True` (numbers, strings,
  containers, tensors only).
Anything else is refused with a one-line CheckpointError naming the file or entry. Tensor data is raw bytes.
titanloop itself stores no pickled objects (see state.py).

    load_dcp(state, path)           # in place, like dcp.load, through SafeFileSystemReader + SafeLoadPlanner
    read_dcp_entries(path)          # every entry of a plain DCP directory as a flat dict (no process group)
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from titanloop.checkpoint.errors import CheckpointError

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # any name: all are plain dataclasses/enums
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module in _ALLOWED and (_ALLOWED[module] is None or name in _ALLOWED[module]):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with the allowlist; CheckpointError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # truncated, garbage or hostile: all mean "cannot use this checkpoint"
        raise CheckpointError(
            f"checkpoint file {path} is corrupt ({type(e).__name__}: {e}); delete "
            f"{path.parent} to resume from an older checkpoint"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint file {path} is not DCP metadata (got {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = read_dcp_metadata(Path(self._get_metadata_path(rank)))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are unpickled with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - an UnpicklingError for anything but plain data
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"checkpoint entry {fqn!r} is not plain data, refusing to load it ({reason})"
            ) from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(state: dict, path, *, no_dist: bool = False) -> None:
    """dcp.load(state) from directory `path`, safely (see the module docstring); CheckpointError if refused."""
    try:
        with warnings.catch_warnings():  # one process reading on its own is what is meant: DCP says so every time
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps errors raised on any rank: surface ours as they are
        for exc in (f[0] if isinstance(f, tuple) else f for f in e.failures.values()):
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise


def read_dcp_entries(path) -> dict:
    """Every entry of a plain DCP directory (tensors and plain data) as a flat {key: value} dict."""
    metadata = read_dcp_metadata(Path(path) / ".metadata").state_dict_metadata
    state = {
        k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for k, md in metadata.items()
    }
    load_dcp(state, path, no_dist=True)
    return state
