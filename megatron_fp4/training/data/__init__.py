"""Training data: the embedded arithmetic corpus, readers for tokenized files, the resumable sampler.

- `arithmetic`: `ArithmeticTokenizer`, `make_problem`, `check_answer`, `ArithmeticDataset`
- `indexed`: Megatron ``.bin``/``.idx`` `IndexedDataset` and `IndexedDatasetWriter`
- `token_datasets`: `NumpyTokenDataset`, `TokenSequenceDataset`, `build_dataset`, `DataError`
- `sampler`: `ResumableSampler`, `get_batch`
- `tokenizer`: `HFTokenizer` (an HF model directory's tokenizer and chat template), `build_bpe_tokenizer`;
  `chat`: `render_chat_template` (as transformers renders it). Both need the ``rl`` extra and are
  imported from their modules, so the core package does not need `tokenizers`/`jinja2`.

RL data (verl-format datasets, the generated carry and math tasks) and rewards are in `megatron_fp4.rl`.
"""
from megatron_fp4.training.data.arithmetic import (
                                                   ArithmeticDataset,
                                                   ArithmeticTokenizer,
                                                   check_answer,
                                                   make_problem,
                                                   )
from megatron_fp4.training.data.indexed import INDEX_MAGIC, IndexedDataset, IndexedDatasetWriter
from megatron_fp4.training.data.sampler import IGNORE_INDEX, ResumableSampler, get_batch
from megatron_fp4.training.data.token_datasets import (
                                                       DATA_KINDS,
                                                       DataError,
                                                       NumpyTokenDataset,
                                                       TokenSequenceDataset,
                                                       build_dataset,
                                                       )

__all__ = [
    "ArithmeticDataset",
    "ArithmeticTokenizer",
    "check_answer",
    "make_problem",
    "INDEX_MAGIC",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "IGNORE_INDEX",
    "ResumableSampler",
    "get_batch",
    "DATA_KINDS",
    "DataError",
    "NumpyTokenDataset",
    "TokenSequenceDataset",
    "build_dataset",
]
