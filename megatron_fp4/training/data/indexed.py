"""Megatron's indexed dataset (``.bin`` + ``.idx``, "MMapIndexedDataset"): reader and writer.

This is the format Megatron-LM's ``tools/preprocess_data.py`` writes, so corpora prepared for
Megatron train here unchanged. Layout of the ``.idx`` file (all little-endian):

    magic   9 bytes  b"MMIDIDX\\x00\\x00"
    version uint64   1
    dtype   uint8    token dtype code (see DTYPE_CODES)
    S       uint64   sequence count
    D       uint64   document count (= documents + 1: document_indices starts with 0)
    sizes   int32[S]     tokens per sequence
    pointers int64[S]    byte offset of each sequence in ``.bin``
    document_indices int64[D]  sequence index where each document starts, then S
    (modes  int8[S]      only in multimodal files; read past, not used)

The ``.bin`` file is the token ids of all sequences back to back. The reader memory-maps both.
"""
from __future__ import annotations

import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
# Megatron-Core's DType enum. Float codes exist in the format but are no token ids.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_TOKEN_CODES = {np.dtype(t): code for code, t in DTYPE_CODES.items() if np.issubdtype(t, np.integer)}


def split_prefix(path: str) -> str:
    """The shared prefix of a ``.bin``/``.idx`` pair; accepts the prefix or either file's name."""
    path = os.fspath(path)
    for suffix in (".idx", ".bin"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _token_dtype(dtype) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in _TOKEN_CODES:
        names = sorted(d.name for d in _TOKEN_CODES)
        raise ValueError(f"dtype {dtype!r} cannot hold token ids in an indexed dataset; use one of {names}")
    return resolved


class IndexedDataset:
    """Read-only view of a Megatron ``.bin``/``.idx`` pair.

    ``len(ds)`` and ``ds[i]`` are per sequence (as in Megatron); `tokens` is the whole ``.bin``
    as one flat token stream, which is what `TokenSequenceDataset` cuts into samples.
    """

    def __init__(self, path_prefix: str):
        prefix = split_prefix(path_prefix)
        self.idx_path, self.bin_path = prefix + ".idx", prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise ValueError(
                    f"indexed dataset file {path!r} does not exist; pass the prefix shared by the "
                    f".bin and .idx files (e.g. 'corpus_text_document' for corpus_text_document.bin)"
                )
        self._read_index()
        self._open_bin()

    def _read_index(self) -> None:
        path = self.idx_path
        file_bytes = os.path.getsize(path)
        with open(path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise ValueError(
                f"{path!r} is not a Megatron .idx file (header {header[:9]!r}, expected {INDEX_MAGIC!r}); "
                "write it with Megatron-LM's preprocess_data.py or IndexedDatasetWriter"
            )
        if len(header) < _HEADER_BYTES:
            raise ValueError(f"{path!r} is truncated: {file_bytes} bytes, shorter than the {_HEADER_BYTES}-byte header")
        version, code, num_sequences, num_doc_indices = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise ValueError(f"{path!r} has index version {version}; only version {INDEX_VERSION} is supported")
        if code not in DTYPE_CODES or not np.issubdtype(DTYPE_CODES[code], np.integer):
            raise ValueError(f"{path!r} has dtype code {code}, which is not an integer token dtype {sorted(_TOKEN_CODES.values())}")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        plain = _HEADER_BYTES + 12 * num_sequences + 8 * num_doc_indices
        if file_bytes not in (plain, plain + num_sequences):  # the second: multimodal, with modes
            raise ValueError(
                f"{path!r} is {file_bytes} bytes but its header promises {num_sequences} sequences and "
                f"{num_doc_indices} document indices ({plain} bytes); the file is truncated or corrupt"
            )
        buffer = np.memmap(path, dtype=np.uint8, mode="r")
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buffer, dtype="<i4", count=num_sequences, offset=offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(buffer, dtype="<i8", count=num_sequences, offset=offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(buffer, dtype="<i8", count=num_doc_indices, offset=offset)
        self._check_index()

    def _check_index(self) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"{self.idx_path!r} has negative sequence lengths; the file is corrupt")
        expected = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=expected[1:])
        # We read the .bin as one flat stream, which needs the sequences stored back to back.
        if not np.array_equal(pointers, expected * self.dtype.itemsize):
            raise ValueError(
                f"{self.idx_path!r}: sequence pointers are not contiguous offsets of the sequence lengths; "
                "the index is corrupt or was written by a different tool"
            )
        if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or np.any(np.diff(docs) < 0):
            raise ValueError(
                f"{self.idx_path!r}: document indices must rise from 0 to the sequence count {lengths.size}; "
                "the index is corrupt"
            )
        self.num_tokens = int(lengths.sum(dtype=np.int64))

    def _open_bin(self) -> None:
        bin_bytes = os.path.getsize(self.bin_path)
        expected = self.num_tokens * self.dtype.itemsize
        if bin_bytes != expected:
            raise ValueError(
                f"{self.bin_path!r} is {bin_bytes} bytes but {self.idx_path!r} describes {self.num_tokens} "
                f"{self.dtype.name} tokens ({expected} bytes); the .bin and .idx do not belong together "
                "or one of them is truncated"
            )
        if self.num_tokens == 0:
            self.tokens = np.empty(0, dtype=self.dtype)  # np.memmap refuses empty files
        else:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    @property
    def num_documents(self) -> int:
        return self.document_indices.size - 1

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def __getitem__(self, index: int) -> np.ndarray:
        """Token ids of sequence ``index`` (a read-only memmap slice)."""
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[index])]

    def get_document(self, index: int) -> np.ndarray:
        """Token ids of document ``index`` (all its sequences)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.num_documents} documents")
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize if first < len(self) else self.num_tokens
        count = int(self.sequence_lengths[first:last].sum(dtype=np.int64))
        return self.tokens[start : start + count]


class IndexedDatasetWriter:
    """Writes a Megatron ``.bin``/``.idx`` pair, one `add_document` call per document.

    Files are written under temporary names and renamed by `finalize`, so a crash never leaves a
    half-written pair that looks complete. Usable as a context manager (finalizes on success,
    discards on an exception).
    """

    def __init__(self, path_prefix: str, dtype=np.uint16):
        self.prefix = split_prefix(path_prefix)
        self.dtype = _token_dtype(dtype)
        self._info = np.iinfo(self.dtype)
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._tmp_bin = self.prefix + ".bin.tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._finalized = False

    def add_document(self, tokens, sequence_lengths=None) -> None:
        """Append one document. ``sequence_lengths`` splits it into several sequences (sentences),
        as ``preprocess_data.py --split-sentences`` does; by default it is one sequence."""
        if self._finalized:
            raise ValueError(f"IndexedDatasetWriter({self.prefix!r}) is already finalized; create a new writer")
        array = np.asarray(tokens)
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise ValueError(f"a document must be a 1-D sequence of integer token ids, got shape {array.shape} dtype {array.dtype}")
        if array.size and (array.min() < self._info.min or array.max() > self._info.max):
            raise ValueError(
                f"token ids in [{array.min()}, {array.max()}] do not fit dtype {self.dtype.name} "
                f"[{self._info.min}, {self._info.max}]; create the writer with a wider dtype (e.g. np.int32)"
            )
        lengths = [array.size] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if sum(lengths) != array.size or any(n < 0 for n in lengths):
            raise ValueError(f"sequence_lengths {lengths} must be non-negative and sum to the document's {array.size} tokens")
        self._bin.write(array.astype(self.dtype.newbyteorder("<")).tobytes(order="C"))
        self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        if self._finalized:
            return
        self._bin.close()
        lengths = np.asarray(self._sequence_lengths, dtype="<i4")
        pointers = np.zeros(lengths.size, dtype="<i8")
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        tmp_idx = self.prefix + ".idx.tmp"
        with open(tmp_idx, "wb") as stream:
            stream.write(INDEX_MAGIC)
            stream.write(struct.pack("<QBQQ", INDEX_VERSION, _TOKEN_CODES[self.dtype], lengths.size, len(self._document_indices)))
            stream.write(lengths.tobytes())
            stream.write(pointers.tobytes())
            stream.write(np.asarray(self._document_indices, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")
        self._finalized = True

    def discard(self) -> None:
        """Drop everything written so far (the temporary files)."""
        if not self._finalized:
            self._bin.close()
            if os.path.exists(self._tmp_bin):
                os.remove(self._tmp_bin)
            self._finalized = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()
