"""Tokenize a text corpus with an HF tokenizer directory and pack it into Megatron ``.bin``/``.idx``.

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer path/to/model \\
        --output-prefix data/corpus                      # -> data/corpus_text_document.{bin,idx}
    python tools/preprocess_data.py --input sft.parquet --tokenizer path/to/model \\
        --chat-key messages --output-prefix data/sft     # chat rows rendered by the chat template

What Megatron-LM's ``tools/preprocess_data.py`` does, for one process: every row of a ``.jsonl``,
``.json`` (a list of rows) or ``.parquet`` file is one document; its ``--text-key`` string is
encoded with the tokenizer (``tokenizer.json`` through `tokenizers`, with the post-processor's
bos/eos framing, as Megatron's HuggingFace tokenizer calls it), or its ``--chat-key`` messages are
rendered with the tokenizer's chat template (as transformers' ``apply_chat_template`` does); the eos
id is appended (``--append-eod``, on by default, as the document separator the GPT dataset
expects), and the document goes to `IndexedDatasetWriter` (uint16 ids when the vocabulary fits, as
Megatron chooses, else int32). Files are read in a stream (parquet by record batches, jsonl by line),
so the corpus need not fit in memory. The output names follow Megatron:
``<prefix>_<key>_document.bin/.idx``; point ``data.kind=megatron data.path=<prefix>_<key>_document``
at them. Nothing in the input executes (JSON and Arrow only).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.training.data.indexed import IndexedDatasetWriter  # noqa: E402

__all__ = ["iter_rows", "encode_row", "preprocess", "output_prefix", "main"]

SUFFIXES = (".jsonl", ".json", ".parquet")


def iter_rows(path, batch_rows: int = 1024) -> Iterator[dict]:
    """The rows of a .jsonl / .json / .parquet file, one dict at a time."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--input {path} does not exist")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"--input {path.name!r}: unsupported file type; use one of {SUFFIXES}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid/OSError variants for a bad file
            raise ValueError(f"--input {path}: not a readable parquet file ({err})") from None
        for batch in parquet.iter_batches(batch_size=batch_rows):
            yield from batch.to_pylist()
        return
    with path.open(encoding="utf-8") as stream:
        if path.suffix == ".json":
            try:
                rows = json.load(stream)
            except json.JSONDecodeError as err:
                raise ValueError(f"--input {path}: not valid JSON ({err})") from None
            if not isinstance(rows, list):
                raise ValueError(f"--input {path}: a .json input must hold a list of row objects (or use .jsonl)")
            yield from rows
            return
        for line_no, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--input {path} line {line_no}: not valid JSON ({err.msg})") from None


def encode_row(row, index: int, tokenizer, text_key: str = "text", chat_key: str | None = None,
               append_eod: bool = True) -> list[int]:
    """Token ids of one row's document (ValueError naming the row and the key when it has none)."""
    key = chat_key or text_key
    if not isinstance(row, dict) or key not in row:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        flag = "--chat-key" if chat_key else "--text-key"
        raise ValueError(f"row {index} has no {key!r} field (it has {found}); choose the field with {flag}")
    value = row[key]
    if chat_key:
        try:
            ids = tokenizer.apply_chat_template(value, add_generation_prompt=False)
        except ValueError as err:
            raise ValueError(f"row {index}, {key!r}: {err}") from None
    else:
        if not isinstance(value, str):
            raise ValueError(f"row {index}: {key!r} is a {type(value).__name__}, not text; for chat messages "
                             "use --chat-key")
        ids = tokenizer.encode(value, add_special_tokens=True)
    return list(ids) + ([tokenizer.eos_id] if append_eod else [])


def output_prefix(prefix, key: str) -> str:
    """Megatron's naming: ``<prefix>_<key>_document``."""
    return f"{prefix}_{key}_document"


def preprocess(input_path, tokenizer_dir, out_prefix, text_key: str = "text", chat_key: str | None = None,
               append_eod: bool = True, log_interval: int = 10000, log=print) -> dict:
    """Tokenize and pack `input_path`; returns {"prefix", "documents", "tokens", "skipped_empty"}."""
    from megatron_fp4.training.data.tokenizer import HFTokenizer

    tokenizer = HFTokenizer.from_dir(tokenizer_dir)
    if append_eod and tokenizer.eos_id is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no eos_token to append as the document separator; "
                         "set eos_token in tokenizer_config.json or pass --no-append-eod")
    if chat_key and tokenizer.chat_template is None:
        raise ValueError(f"{tokenizer_dir} has no chat template for --chat-key; add chat_template to "
                         "tokenizer_config.json or use --text-key on plain text")
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32  # Megatron's choice
    prefix = output_prefix(out_prefix, chat_key or text_key)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    stats = {"prefix": prefix, "documents": 0, "tokens": 0, "skipped_empty": 0}
    start = time.perf_counter()
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:  # discards the temporary files on an error
        for index, row in enumerate(iter_rows(input_path)):
            ids = encode_row(row, index, tokenizer, text_key, chat_key, append_eod)
            if not ids:
                stats["skipped_empty"] += 1
                continue
            writer.add_document(ids)
            stats["documents"] += 1
            stats["tokens"] += len(ids)
            if log_interval and stats["documents"] % log_interval == 0:
                elapsed = time.perf_counter() - start
                log(f"processed {stats['documents']} documents, {stats['tokens']} tokens "
                    f"({stats['documents'] / elapsed:.0f} docs/s, {stats['tokens'] / elapsed:.0f} tokens/s)")
        if stats["documents"] == 0:
            raise ValueError(f"--input {input_path}: no document with tokens ({stats['skipped_empty']} empty rows); "
                             "nothing to train on")
    log(f"wrote {prefix}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens ({np.dtype(dtype).name})"
        + (f", {stats['skipped_empty']} empty rows skipped" if stats["skipped_empty"] else "")
        + f"; train with data.kind=megatron data.path={prefix} model.vocab_size>={tokenizer.vocab_size}")
    return stats


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="a .jsonl, .json (list of rows) or .parquet file")
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory (tokenizer.json, tokenizer_config.json)")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    ap.add_argument("--text-key", default="text", help="the row field holding the document text (default: text)")
    ap.add_argument("--chat-key", help="a row field of chat messages [{role, content}], rendered by the chat template")
    ap.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                    help="do not append the eos id after each document")
    ap.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines (0: none)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        preprocess(args.input, args.tokenizer, args.output_prefix, args.text_key, args.chat_key, args.append_eod,
                   args.log_interval, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
