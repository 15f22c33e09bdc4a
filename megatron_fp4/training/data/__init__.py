"""Training data: the embedded arithmetic corpus, readers for tokenized files, the resumable sampler.

- `arithmetic`: `ArithmeticTokenizer`, `make_problem`, `check_answer`, `ArithmeticDataset`
- `indexed`: Megatron ``.bin``/``.idx`` `IndexedDataset` and `IndexedDatasetWriter`
- `token_datasets`: `NumpyTokenDataset`, `TokenSequenceDataset`, `build_dataset`, `DataError`
- `sampler`: `ResumableSampler`, `get_batch`
- `tokenizer`: `HFTokenizer` (an HF model directory's tokenizer and chat template), `build_bpe_tokenizer`;
  `chat`: `render_chat_template` (as transformers renders it). Both need the ``rl`` extra and are
  imported from their modules, so the core package does not need `tokenizers`/`jinja2`.
- `rl_dataset`: `RLDataset` (verl-format parquet/json rows, as verl's RLHFDataset reads them),
  `write_parquet`; `math_task`: a generated GSM8K-style set in that format and its tokenizer;
  `carry_task`: column addition with carries and a sloppy SFT teacher (the RL task of docs/ablation.md)
- rewards (rule-based math verifiers, registry by data_source) live in `megatron_fp4.training.rewards`
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
