"""Reading DCP's `.metadata` as data: torch's `FileSystemReader.read_metadata` runs a plain
`pickle.load`, so a crafted `.metadata` could run code. `SafeFileSystemReader` unpickles it with an
allow-list of the classes DCP itself writes there (its metadata dataclasses, `torch.Size`, dtypes,
layouts, paths); any other global is refused with a CheckpointError naming the file and the global.
Every metadata read of ours (and `dcp.load`, through `storage_reader=`) goes through it.
"""
from __future__ import annotations

import pathlib
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_md

from megatron_fp4.training.checkpoint.directory import CheckpointError, CorruptCheckpointError

METADATA_FILE = ".metadata"


_PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def _allowed() -> dict:
    names = {dcp_md.__name__: ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                               "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
             dcp_filesystem.__name__: ("_StorageInfo",),
             "pathlib": _PATHS, "pathlib._local": _PATHS,  # Python >= 3.13 pickles paths from pathlib._local
             "torch": ("Size",),
             "torch.serialization": ("_get_layout",),  # maps a layout's name to torch's layout object
             "collections": ("OrderedDict",),
             "builtins": ("set", "frozenset")}
    modules = {dcp_md.__name__: dcp_md, dcp_filesystem.__name__: dcp_filesystem, "pathlib": pathlib,
               "pathlib._local": pathlib, "torch": torch,
               "torch.serialization": torch.serialization, "collections": __import__("collections"),
               "builtins": __import__("builtins")}
    return {(mod, name): getattr(modules[mod], name) for mod, group in names.items() for name in group
            if hasattr(modules[mod], name)}


_ALLOWED = _allowed()


class ForbiddenGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.global_name = f"{module}.{name}"


class MetadataUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals (and torch dtypes); everything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ForbiddenGlobal(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata_file(path: pathlib.Path, stream=None) -> dcp_md.Metadata:
    """The `Metadata` in `path` (or the open binary `stream` of it), unpickled with the allow-list."""
    try:
        if stream is None:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        else:
            metadata = MetadataUnpickler(stream).load()
    except ForbiddenGlobal as err:
        raise CheckpointError(f"{path} refers to {err.global_name}, which DCP metadata never holds; refused to "
                              f"load it (nothing in a checkpoint is executed). The file was not written by "
                              f"torch.distributed.checkpoint: do not use this checkpoint") from None
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise CorruptCheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is damaged or "
                                     f"truncated") from None
    if not isinstance(metadata, dcp_md.Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata: it is damaged")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` uses the allow-list unpickler."""

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        get_path = getattr(self, "_get_metadata_path", None)
        path = get_path(rank) if get_path is not None else pathlib.Path(self.path) / METADATA_FILE
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata_file(pathlib.Path(path), stream)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
