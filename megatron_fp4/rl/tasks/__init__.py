"""RL tasks: where prompts come from and how answers are rewarded.

- `catalog`: the tasks the GRPO loop samples (`ArithmeticTask`, `DatasetTask`, `CarryTask`) and their held-out sets
- `rewards`: rule-based verifiers by data_source

- `rl_dataset`: `RLDataset` (verl-format parquet/json rows, as verl's RLHFDataset reads them),
  `write_parquet`, `read_rows`
- `math_task`: a generated GSM8K-style set in that format and its tokenizer
- `carry_task`: column addition with carries and a sloppy SFT teacher (the RL task of docs/ablation.md)

The tokenizers
(`training.data.tokenizer`) are shared with pretraining.
"""
