"""verl-format RL prompt datasets: parquet (or json/jsonl) rows read the way verl's `RLHFDataset` does.

A row (what verl's ``examples/data_preprocess/gsm8k.py`` writes)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "... output the final answer after \\"####\\"."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

Like verl (0.5 to 0.9): files are concatenated in order; ``max_samples`` keeps the first rows;
with ``filter_overlong_prompts`` rows whose chat-rendered prompt (generation prompt added) has more
than ``max_prompt_length`` tokens are dropped; an item is the row's columns plus ``raw_prompt`` (the
messages), ``index`` (``extra_info.index``, else 0), ``tools_kwargs`` and ``interaction_kwargs``.
verl's agent loop then renders ``raw_prompt`` with the tokenizer's chat template; we do that here
too and add ``prompt_ids``. tests/integration/test_rl_data_verl.py compares item by item with
verl's own `RLHFDataset` and its ``apply_chat_template``.

Files are data only: parquet through pyarrow, JSON through ``json``; nothing executes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = ["RLDataset", "read_rows", "read_table", "write_parquet", "check_row"]

TRUNCATIONS = ("error", "left", "right")


def read_table(path):
    """One .parquet, .json (a list of rows) or .jsonl file as a pyarrow Table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"RL data file {path} does not exist (data.rl_files / --data)")
    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8")
        try:
            if path.suffix == ".jsonl":
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: a .json RL data file must hold a list of row objects")
        try:
            return pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise ValueError(f"{path}: the rows do not share one column type ({err}); every row's prompt must be "
                             "a list of {role, content} messages with text content") from None
    raise ValueError(f"unsupported RL data file {path.name!r}: use .parquet, .json or .jsonl (as verl does)")


def read_rows(paths) -> list[dict]:
    """The rows of all `paths` in order, as Python dicts. The files are concatenated as Arrow tables
    with their schemas unified (as verl's `datasets.concatenate_datasets` does), so a struct field
    one file lacks reads as None in its rows."""
    import pyarrow as pa

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    tables = [read_table(p) for p in paths]
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"the RL data files {[str(p) for p in paths]} have incompatible columns ({err})") from None
    return table.to_pylist()


def write_parquet(rows: Sequence[dict], path) -> Path:
    """Write verl-format rows to a parquet file (pyarrow infers the nested struct/list schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def check_row(row: dict, where: str, prompt_key: str = "prompt") -> None:
    """ValueError naming the row and the field when `row` is not a verl RL row."""
    for key in (prompt_key, "data_source", "reward_model"):
        if key not in row:
            raise ValueError(f"{where}: no {key!r} column; a verl RL row has prompt (chat messages), data_source, "
                             "reward_model {style, ground_truth} and optionally extra_info")
    reward = row["reward_model"]
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        raise ValueError(f"{where}: reward_model must be a dict with 'ground_truth' (and 'style': 'rule'), "
                         f"got {reward!r}")
    messages = row[prompt_key]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty list of {{role, content}} messages")
    bad = [i for i, m in enumerate(messages) if not isinstance(m["content"], (str, list, type(None)))]
    if bad:
        content = messages[bad[0]]["content"]
        raise ValueError(f"{where}: {prompt_key}[{bad[0]}]['content'] is a {type(content).__name__} ({content!r}); "
                         "a message's content must be text (a string)")


class RLDataset:
    """Prompts of verl-format files, rendered with `tokenizer`'s chat template (an `HFTokenizer`)."""

    def __init__(self, files: Union[str, Path, Sequence], tokenizer, max_prompt_length: int = 1024,
                 prompt_key: str = "prompt", filter_overlong_prompts: bool = True, truncation: str = "error",
                 max_samples: int = -1, apply_chat_template_kwargs: Optional[dict] = None):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r} must be one of {TRUNCATIONS} (verl's data.truncation)")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length!r} must be an integer >= 1")
        files = [files] if isinstance(files, (str, Path)) else list(files)
        self.tokenizer = tokenizer
        self.prompt_key, self.max_prompt_length, self.truncation = prompt_key, max_prompt_length, truncation
        self.template_kwargs = dict(apply_chat_template_kwargs or {})
        rows = read_rows(files)
        for i, row in enumerate(rows):
            check_row(row, f"row {i} of {[str(f) for f in files]}", prompt_key)
        if 0 < max_samples < len(rows):
            rows = rows[:max_samples]
        self.rows, self.prompt_ids = [], []
        for i, row in enumerate(rows):
            try:
                ids = self._render(row[prompt_key])
            except ValueError as err:  # a message the chat template cannot render (ChatTemplateError, bad content)
                raise ValueError(f"row {i} of {[str(f) for f in files]}, {prompt_key!r}: {err}") from None
            if filter_overlong_prompts and len(ids) > max_prompt_length:
                continue
            self.rows.append(row)
            self.prompt_ids.append(ids)
        if not self.rows:
            raise ValueError(f"no prompt of {[str(f) for f in files]} fits max_prompt_length={max_prompt_length} "
                             "tokens; raise it")

    def _render(self, messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **self.template_kwargs)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        row = dict(self.rows[item])
        extra = row.get("extra_info") or {}
        row["extra_info"] = extra
        row["raw_prompt"] = row[self.prompt_key]
        row["index"] = extra.get("index", 0)
        row["tools_kwargs"] = extra.get("tools_kwargs", {})
        row["interaction_kwargs"] = extra.get("interaction_kwargs", {})
        row["prompt_ids"] = self._fit(self.prompt_ids[item], item)
        return row

    def _fit(self, ids: list, item: int) -> list:
        """Prompt ids cut to max_prompt_length when filtering was off (verl's truncation setting)."""
        if len(ids) <= self.max_prompt_length:
            return list(ids)
        if self.truncation == "error":
            raise ValueError(f"prompt {item} has {len(ids)} tokens > max_prompt_length={self.max_prompt_length}; "
                             "raise it, filter_overlong_prompts=True, or truncation='left'/'right'")
        return list(ids[-self.max_prompt_length:] if self.truncation == "left" else ids[:self.max_prompt_length])

    def ground_truth(self, item: int):
        return self.rows[item]["reward_model"]["ground_truth"]
