"""A DCP FileSystemReader whose `.metadata` unpickler only builds DCP metadata classes.

DCP stores its metadata with pickle, and a pickle can run arbitrary code when loaded. This reader allows
only the classes a DCP metadata file consists of (dataclasses from torch.distributed.checkpoint, torch.Size,
dtypes/layouts, paths); anything else is refused with a one-line CheckpointError. Tensor data is read as raw
bytes by DCP itself; titanloop stores no pickled objects (see state.py).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
        raise CheckpointError(f"checkpoint file {path} is corrupt ({type(e).__name__}: {e}); delete "
                              f"{path.parent} to resume from an older checkpoint") from None
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
