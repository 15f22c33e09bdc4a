"""tools/preprocess_data.py: text and chat rows -> Megatron .bin/.idx, checked against transformers'
tokenizer for the same directory (exact ids: the same `tokenizers` pipeline and Jinja template, no
tolerance), read back with our IndexedDataset, and trained on by the Trainer."""
import json
import math

import numpy as np
import pytest

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rl.tasks.rl_dataset import write_parquet
from megatron_fp4.training.data import IndexedDataset
from megatron_fp4.training.data.tokenizer import build_bpe_tokenizer
from megatron_fp4.training.trainer import Trainer
from tools import preprocess_data

import transformers  # the test extra installs it: a missing package fails, never skips

TEXTS = [f"Tom has {a} pens and gets {b} more, so he has {a + b}. ümlaut ✓" for a in range(9) for b in range(7)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE whose post-processor prepends a bos token (as Llama's does), so the text path's
    special-token framing is exercised."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("tok")
    build_bpe_tokenizer(out, TEXTS + ["user", "assistant"], vocab_size=300)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[
        (bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(config, bos_token=bos)))
    return out


def _ids(out):
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_text_jsonl_round_trip_matches_transformers(tmp_path, tok_dir, capsys):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    rows = [{"text": t, "id": i} for i, t in enumerate(TEXTS)] + [{"text": ""}]
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert preprocess_data.main(["--input", str(tmp_path / "corpus.jsonl"), "--tokenizer", str(tok_dir),
                                 "--output-prefix", str(tmp_path / "out" / "corpus"), "--log-interval", "20"]) == 0
    log = capsys.readouterr().err
    assert "processed 60 documents" in log and "data.path=" in log
    data = IndexedDataset(str(tmp_path / "out" / "corpus_text_document"))
    assert data.dtype == np.dtype("<u2") and len(data) == data.num_documents == len(rows)
    for i, row in enumerate(rows):
        want = hf(row["text"])["input_ids"] + [hf.eos_token_id]
        assert want[0] == hf.bos_token_id and data.get_document(i).tolist() == want
    stats = preprocess_data.preprocess(tmp_path / "corpus.jsonl", tok_dir, tmp_path / "noeod", append_eod=False,
                                       log=lambda msg: None)
    noeod = IndexedDataset(stats["prefix"])
    assert stats["skipped_empty"] == 0 and len(noeod) == len(rows)  # "" still gets the post-processor's bos
    assert noeod[0].tolist() == hf(rows[0]["text"])["input_ids"]
    # A tokenizer without bos framing: the empty row has no tokens and is skipped (and counted).
    build_bpe_tokenizer(tmp_path / "plain_tok", TEXTS, vocab_size=300)
    stats = preprocess_data.preprocess(tmp_path / "corpus.jsonl", tmp_path / "plain_tok", tmp_path / "plain",
                                       append_eod=False, log=lambda msg: None)
    assert stats["skipped_empty"] == 1 and len(IndexedDataset(stats["prefix"])) == len(rows) - 1


def test_chat_parquet_matches_transformers_template_and_trains(tmp_path, tok_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    chats = [[{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]
             for a in range(12) for b in range(10)]
    write_parquet([{"messages": m, "source": "gen"} for m in chats], tmp_path / "sft.parquet")
    stats = preprocess_data.preprocess(tmp_path / "sft.parquet", tok_dir, tmp_path / "sft", chat_key="messages",
                                       log=lambda msg: None)
    data = IndexedDataset(stats["prefix"])
    assert stats["prefix"].endswith("sft_messages_document") and len(data) == len(chats)
    for i in (0, 57, len(chats) - 1):
        assert data[i].tolist() == _ids(hf.apply_chat_template(chats[i], tokenize=True)) + [hf.eos_token_id]
    assert data.num_tokens == stats["tokens"]
    cfg = load_config(default_config_path(), [
        "model.num_layers=1", f"model.vocab_size={len(hf)}", "schedule.seq_len=32", "schedule.global_batch_size=4",
        "schedule.micro_batch_size=4", "schedule.train_steps=2", "schedule.warmup_steps=0", "logging.progress=false",
        "logging.tensorboard_dir=null", "checkpoint.dir=null", "data.kind=megatron", f"data.path={stats['prefix']}"])
    history = Trainer(cfg).train()
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)


def test_errors_name_the_problem_and_leave_no_files(tmp_path, tok_dir, capsys):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    args = ["--input", str(tmp_path / "rows.jsonl"), "--tokenizer", str(tok_dir), "--output-prefix",
            str(tmp_path / "bad")]
    assert preprocess_data.main(args) == 2
    assert "row 1 has no 'text' field (it has ['body'])" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad*"))  # the writer's temporary files are discarded
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": ["not", "text"]}) + "\n")
    with pytest.raises(ValueError, match="not text; for chat messages use --chat-key"):
        preprocess_data.preprocess(tmp_path / "rows.jsonl", tok_dir, tmp_path / "bad")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(ValueError, match="row 0, 'messages'"):
        preprocess_data.preprocess(tmp_path / "rows.jsonl", tok_dir, tmp_path / "bad", chat_key="messages")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        preprocess_data.preprocess(tmp_path / "rows.jsonl", tok_dir, tmp_path / "bad")
    for name, match in [("missing.jsonl", "does not exist"), ("rows.csv", "unsupported file type")]:
        (tmp_path / "rows.csv").write_text("text\n")
        with pytest.raises(ValueError, match=match):
            preprocess_data.preprocess(tmp_path / name, tok_dir, tmp_path / "bad")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        preprocess_data.preprocess(tmp_path / "rows.csv", tmp_path, tmp_path / "bad")
    assert not list(tmp_path.glob("bad*"))
