"""RL data: prompts with ground truth in verl's row format, and the generated tasks.

- `rl_dataset`: `RLDataset` (verl-format parquet/json rows, as verl's RLHFDataset reads them),
  `write_parquet`, `read_rows`
- `math_task`: a generated GSM8K-style set in that format and its tokenizer
- `carry_task`: column addition with carries and a sloppy SFT teacher (the RL task of docs/ablation.md)

Rewards (rule-based verifiers by data_source) are `megatron_fp4.rl.rewards`. The tokenizers
(`training.data.tokenizer`) are shared with pretraining.
"""
