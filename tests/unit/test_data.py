"""Training data: arithmetic corpus, Megatron indexed files, numpy tokens, resumable sampler."""
import random
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_fp4.training.data import (
                                        IGNORE_INDEX,
                                        INDEX_MAGIC,
                                        ArithmeticDataset,
                                        ArithmeticTokenizer,
                                        IndexedDataset,
                                        IndexedDatasetWriter,
                                        NumpyTokenDataset,
                                        ResumableSampler,
                                        TokenSequenceDataset,
                                        build_dataset,
                                        check_answer,
                                        get_batch,
                                        make_problem,
                                        )


# ---------------------------------------------------------------- tokenizer and arithmetic task


def test_tokenizer_vocabulary_and_roundtrip():
    tok = ArithmeticTokenizer()
    assert tok.vocab_size == 18
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.eq_id}) == 4
    text = "12+7=19 34-5=29 6*7=42"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False, add_eos=False) == ids[1:-1]
    assert tok.decode(ids, skip_special=False) == f"<bos>{text}<eos>"
    assert tok.decode(torch.tensor(tok.encode("1+1=2") + tok.encode("9")), stop_at_eos=True) == "1+1=2"
    assert ids[text.index("=") + 1] == tok.eq_id


@pytest.mark.parametrize("bad", ["12/3=4", "é"])
def test_tokenizer_rejects_unknown_characters(bad):
    with pytest.raises(ValueError, match="not in the arithmetic vocabulary"):
        ArithmeticTokenizer().encode(bad)


def test_tokenizer_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="outside the arithmetic vocabulary"):
        ArithmeticTokenizer().decode([3, 18])


def test_make_problem_is_correct_and_in_range():
    rng = random.Random(0)
    seen_ops = set()
    for _ in range(500):
        prompt, answer = make_problem(rng, max_operand=20)
        op = next(o for o in "+-*" if o in prompt)
        a, b = (int(x) for x in prompt[:-1].split(op))
        seen_ops.add(op)
        assert prompt.endswith("=") and 0 <= a <= 20 and 0 <= b <= 20
        assert int(answer) == eval(prompt[:-1])  # noqa: S307 - our own digits-and-operator string
        assert answer.isdigit()  # subtraction never goes negative
    assert seen_ops == {"+", "-", "*"}
    assert all("*" not in make_problem(rng, ops="+-")[0] for _ in range(100))


def test_make_problem_accepts_numpy_generator():
    prompt, answer = make_problem(np.random.Generator(np.random.PCG64(3)), max_operand=9, ops="+")
    assert check_answer(prompt, answer)


@pytest.mark.parametrize("kwargs", [{"max_operand": 0}, {"ops": ""}, {"ops": "+/"}])
def test_make_problem_rejects_bad_task(kwargs):
    with pytest.raises(ValueError):
        make_problem(random.Random(0), **kwargs)


@pytest.mark.parametrize(
    "prompt,completion,expected",
    [
        ("12+7=", "19", True),
        ("12+7=", "19<eos>", True),
        ("12+7=", " 19 and more", True),
        ("<bos>34-5=", "29", True),
        ("6*7=", "42\x00", True),
        ("1+1=2 6*7=", "42", True),  # few-shot prompt: the last problem is graded
        ("12+7=", "190", False),
        ("12+7=", "18", False),
        ("12+7=", "", False),
        ("12+7=", "<eos>19", False),
        ("12+7=", "1" * 5000, False),  # too long for int(); must not raise
    ],
)
def test_check_answer(prompt, completion, expected):
    assert check_answer(prompt, completion) is expected


def test_check_answer_rejects_prompt_without_problem():
    with pytest.raises(ValueError, match="does not end with a problem"):
        check_answer("hello", "19")


def test_arithmetic_dataset_is_deterministic_and_packed():
    ds = ArithmeticDataset(num_samples=64, seq_len=32, seed=7)
    again = ArithmeticDataset(num_samples=64, seq_len=32, seed=7)
    other = ArithmeticDataset(num_samples=64, seq_len=32, seed=8)
    assert len(ds) == 64 and ds.vocab_size == 18 and ds.pad_id == 0
    samples = torch.stack([ds[i] for i in range(len(ds))])
    assert samples.dtype == torch.long and samples.shape == (64, 33)
    assert torch.equal(samples, torch.stack([again[i] for i in reversed(range(64))]).flip(0))
    assert not torch.equal(samples, torch.stack([other[i] for i in range(64)]))
    assert torch.equal(ds[-1], ds[63])
    # Packing: each sample starts at a problem, holds several complete, correct problems, no padding.
    tok = ds.tokenizer
    assert bool((samples[:, 0] == tok.bos_id).all()) and not bool((samples == tok.pad_id).any())
    text = tok.decode(samples[0], skip_special=False)
    problems = [p for p in text.split("<eos>")[:-1]]
    assert len(problems) >= 2
    for problem in problems:
        prompt, answer = problem.removeprefix("<bos>").split("=")
        assert check_answer(prompt + "=", answer)
    with pytest.raises(IndexError):
        ds[64]


def test_arithmetic_dataset_respects_options():
    ds = ArithmeticDataset(num_samples=8, seq_len=64, seed=0, max_operand=9, ops="+")
    text = ds.tokenizer.decode(torch.cat([ds[i] for i in range(8)]), skip_special=False)
    assert "-" not in text and "*" not in text
    for problem in text.split("<bos>")[1:-1]:
        left = problem.split("=")[0]
        assert all(len(x) == 1 for x in left.split("+"))


@pytest.mark.parametrize("kwargs", [{"num_samples": 0}, {"seq_len": 0}, {"max_operand": -1}, {"ops": "^"}])
def test_arithmetic_dataset_rejects_bad_arguments(kwargs):
    args = {"num_samples": 4, "seq_len": 8, "seed": 0} | kwargs
    with pytest.raises(ValueError):
        ArithmeticDataset(**args)


# ---------------------------------------------------------------- Megatron indexed files


def _write(prefix, docs, dtype):
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_indexed_dataset_roundtrip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 60_000)
    docs = [rng.integers(0, high, size=n) for n in (5, 1, 17, 0, 9)]
    _write(tmp_path / "corpus", docs, dtype)
    ds = IndexedDataset(str(tmp_path / "corpus"))
    assert ds.dtype == np.dtype(dtype) and len(ds) == 5 and ds.num_documents == 5
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        np.testing.assert_array_equal(ds.get_document(i), doc)
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    assert ds.num_tokens == 32
    # Either file name works as the prefix, as in Megatron's --data-path habits.
    assert IndexedDataset(str(tmp_path / "corpus.bin")).num_tokens == 32


def test_indexed_file_layout_matches_megatron(tmp_path):
    """Byte layout written by Megatron-Core's _IndexWriter: magic, <Q version, <B dtype code (8 =
    uint16), <Q sequence count, <Q document count (docs + 1), int32 sizes, int64 pointers, int64 doc idx."""
    _write(tmp_path / "c", [[1, 2, 3], [4, 5]], np.uint16)
    raw = (tmp_path / "c.idx").read_bytes()
    expected = INDEX_MAGIC + struct.pack("<QBQQ", 1, 8, 2, 3)
    expected += np.array([3, 2], "<i4").tobytes() + np.array([0, 6], "<i8").tobytes()
    expected += np.array([0, 1, 2], "<i8").tobytes()
    assert raw == expected
    assert (tmp_path / "c.bin").read_bytes() == np.array([1, 2, 3, 4, 5], "<u2").tobytes()


def test_indexed_multi_sequence_documents(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "s"), np.int32) as writer:
        writer.add_document([1, 2, 3, 4, 5], sequence_lengths=[2, 3])
        writer.add_document([6])
    ds = IndexedDataset(str(tmp_path / "s"))
    assert len(ds) == 3 and ds.num_documents == 2
    np.testing.assert_array_equal(ds[1], [3, 4, 5])
    np.testing.assert_array_equal(ds.get_document(0), [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])


def test_indexed_bad_magic_names_file(tmp_path):
    _write(tmp_path / "c", [[1, 2, 3]], np.uint16)
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(b"NOTMAGIC!" + raw[9:])
    with pytest.raises(ValueError, match=r"c\.idx.*not a Megatron \.idx"):
        IndexedDataset(str(tmp_path / "c"))


def test_indexed_size_mismatch_is_reported(tmp_path):
    _write(tmp_path / "c", [[1, 2, 3], [4]], np.uint16)
    (tmp_path / "c.bin").write_bytes(np.array([1, 2, 3], "<u2").tobytes())
    with pytest.raises(ValueError, match=r"c\.bin.*6 bytes.*4 uint16 tokens"):
        IndexedDataset(str(tmp_path / "c"))
    (tmp_path / "c.idx").write_bytes((tmp_path / "c.idx").read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        IndexedDataset(str(tmp_path / "c"))


def test_indexed_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_writer_validates_and_is_atomic(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "w"), np.uint16)
    with pytest.raises(ValueError, match="wider dtype"):
        writer.add_document([70_000])
    with pytest.raises(ValueError, match="1-D"):
        writer.add_document([[1, 2]])
    with pytest.raises(ValueError, match="sum to"):
        writer.add_document([1, 2], sequence_lengths=[1])
    writer.add_document([1, 2])
    assert not (tmp_path / "w.bin").exists()  # nothing visible before finalize
    writer.finalize()
    assert (tmp_path / "w.bin").exists() and (tmp_path / "w.idx").exists()
    with pytest.raises(ValueError, match="already finalized"):
        writer.add_document([3])
    with pytest.raises(ValueError, match="cannot hold token ids"):
        IndexedDatasetWriter(str(tmp_path / "f"), np.float32)
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.int32) as w:
            w.add_document([1])
            raise RuntimeError("boom")
    assert list(p.name for p in tmp_path.iterdir() if p.name.startswith("x")) == []


# ---------------------------------------------------------------- numpy tokens and sequence cutting


def test_numpy_token_dataset(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(50, dtype=np.uint16))
    source = NumpyTokenDataset(str(tmp_path / "t.npy"))
    assert source.num_tokens == 50 and isinstance(source.tokens, np.memmap)
    np.save(tmp_path / "bad.npy", np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="1-D integer"):
        NumpyTokenDataset(str(tmp_path / "bad.npy"))
    with pytest.raises(ValueError, match="does not exist"):
        NumpyTokenDataset(str(tmp_path / "missing.npy"))


def test_token_sequence_dataset_cuts_overlapping_samples():
    ds = TokenSequenceDataset(np.arange(23, dtype=np.uint16), seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    assert ds[0].tolist() == [0, 1, 2, 3, 4, 5] and ds[3].tolist() == [15, 16, 17, 18, 19, 20]
    assert ds[1].dtype == torch.long
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenSequenceDataset(np.arange(5), seq_len=5)


def test_token_sequence_dataset_over_indexed_documents(tmp_path):
    _write(tmp_path / "c", [[1, 2, 3], [4, 5, 6, 7], [8, 9]], np.int32)
    ds = TokenSequenceDataset(IndexedDataset(str(tmp_path / "c")), seq_len=4)
    assert len(ds) == 2
    assert ds[0].tolist() == [1, 2, 3, 4, 5] and ds[1].tolist() == [5, 6, 7, 8, 9]


# ---------------------------------------------------------------- build_dataset


def test_build_dataset_kinds(tmp_path):
    arith = build_dataset(SimpleNamespace(kind="arithmetic", path=None, num_samples=10, max_operand=9), 16, seed=1)
    assert isinstance(arith, ArithmeticDataset) and len(arith) == 10 and arith[0].shape == (17,)
    assert torch.equal(arith[3], ArithmeticDataset(10, 16, 1, max_operand=9)[3])
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    numpy_ds = build_dataset({"kind": "numpy", "path": str(tmp_path / "t.npy"), "num_samples": 0, "max_operand": 9}, 9, 0)
    assert len(numpy_ds) == 11
    _write(tmp_path / "m", [list(range(40))], np.uint16)
    mega = build_dataset(SimpleNamespace(kind="megatron", path=str(tmp_path / "m"), num_samples=0, max_operand=9), 9, 0)
    assert len(mega) == 4 and mega[1].tolist() == list(range(9, 19))


@pytest.mark.parametrize("kind,suffix", [("megatron", ""), ("numpy", ".npy")])
def test_build_dataset_missing_file_names_path_and_field(tmp_path, kind, suffix):
    path = str(tmp_path / f"absent{suffix}")
    with pytest.raises(ValueError, match=r"data\.path=.*absent"):
        build_dataset(SimpleNamespace(kind=kind, path=path, num_samples=1, max_operand=9), 8, 0)
    with pytest.raises(ValueError, match=r"data\.path is not set"):
        build_dataset(SimpleNamespace(kind=kind, path=None, num_samples=1, max_operand=9), 8, 0)


def test_build_dataset_reads_the_project_data_config():
    from megatron_fp4.config import DataConfig

    ds = build_dataset(DataConfig(kind="arithmetic", num_samples=6, max_operand=5), 12, seed=2)
    assert len(ds) == 6 and ds.max_operand == 5 and ds[5].shape == (13,)


def test_build_dataset_unknown_kind():
    with pytest.raises(ValueError, match=r"data\.kind='text'"):
        build_dataset(SimpleNamespace(kind="text", path=None, num_samples=1, max_operand=9), 8, 0)


# ---------------------------------------------------------------- sampler and batches


def _take(sampler, steps):
    return [sampler.next_batch() for _ in range(steps)]


def test_sampler_covers_each_epoch_once_and_is_seeded():
    sampler = ResumableSampler(dataset_len=23, global_batch_size=5, seed=3)
    assert sampler.steps_per_epoch == 4
    epoch0 = _take(sampler, 4)
    assert len(set(sum(epoch0, []))) == 20  # tail of 3 skipped, no repeats
    epoch1 = _take(sampler, 4)
    assert epoch1 != epoch0 and sampler.state_dict() == {"epoch": 1, "consumed": 20}
    assert _take(ResumableSampler(23, 5, seed=3), 8) == epoch0 + epoch1
    assert _take(ResumableSampler(23, 5, seed=4), 4) != epoch0
    assert _take(ResumableSampler(23, 5, seed=3, shuffle=False), 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    iterator = iter(ResumableSampler(23, 5, seed=3))
    assert [next(iterator) for _ in range(8)] == epoch0 + epoch1


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 5, 9, 13])
def test_sampler_resume_gives_remaining_batches(stop):
    full = _take(ResumableSampler(23, 5, seed=11), 14)
    first = ResumableSampler(23, 5, seed=11)
    _take(first, stop)
    resumed = ResumableSampler(23, 5, seed=11)
    resumed.load_state_dict(first.state_dict())
    assert _take(resumed, 14 - stop) == full[stop:]


def test_sampler_dp_parts_concatenate_to_global_batch():
    reference = _take(ResumableSampler(40, 8, seed=5), 12)
    ranks = [ResumableSampler(40, 8, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    parts = [_take(s, 12) for s in ranks]
    for step in range(12):
        assert all(len(p[step]) == 2 for p in parts)
        assert sum((p[step] for p in parts), []) == reference[step]


def test_sampler_dp_size_change_on_resume():
    reference = _take(ResumableSampler(40, 8, seed=5), 12)
    before = [ResumableSampler(40, 8, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for s in before:
        _take(s, 7)
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    after = [ResumableSampler(40, 8, seed=5, dp_rank=r, dp_size=4) for r in range(4)]
    for s in after:
        s.load_state_dict(state)
    parts = [_take(s, 5) for s in after]
    assert [sum((p[k] for p in parts), []) for k in range(5)] == reference[7:]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"global_batch_size": 6, "dp_size": 4}, "not divisible"),
        ({"dp_rank": 2, "dp_size": 2}, "smaller than dp_size"),
        ({"global_batch_size": 50}, "larger than the dataset"),
        ({"global_batch_size": 0}, "global_batch_size"),
    ],
)
def test_sampler_rejects_bad_layout(kwargs, match):
    args = {"dataset_len": 40, "global_batch_size": 8, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        ResumableSampler(**args)


def test_sampler_rejects_bad_state():
    sampler = ResumableSampler(40, 8, seed=0)
    with pytest.raises(ValueError, match="no 'consumed'"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="exceeds the dataset length"):
        sampler.load_state_dict({"epoch": 0, "consumed": 41})


def test_get_batch_shifts_and_masks_padding():
    ds = ArithmeticDataset(num_samples=4, seq_len=16, seed=0)
    tokens, labels = get_batch(ds, [2, 0])
    assert tokens.shape == labels.shape == (2, 16) and tokens.dtype == labels.dtype == torch.long
    assert torch.equal(tokens[0], ds[2][:-1]) and torch.equal(labels[1], ds[0][1:])
    padded = [torch.tensor([1, 4, 5, 2, 0, 0]), torch.tensor([1, 4, 2, 0, 7, 8])]
    tokens, labels = get_batch(padded, [0, 1], pad_id=0)
    assert labels.tolist() == [[4, 5, 2, IGNORE_INDEX, IGNORE_INDEX], [4, 2, IGNORE_INDEX, IGNORE_INDEX, 8]]
    assert tokens.tolist() == [[1, 4, 5, 2, 0], [1, 4, 2, 0, 7]]
    unmasked = TokenSequenceDataset(np.array([0, 1, 0, 2, 0]), seq_len=4)
    assert get_batch(unmasked, [0])[1].tolist() == [[1, 0, 2, 0]]  # file data: token 0 is a real token
    with pytest.raises(ValueError, match="at least one"):
        get_batch(ds, [])


def test_config_knows_the_arithmetic_vocab_size():
    from megatron_fp4.config.validate import ARITHMETIC_VOCAB_SIZE

    assert ArithmeticTokenizer().vocab_size == ARITHMETIC_VOCAB_SIZE
