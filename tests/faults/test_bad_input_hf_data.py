"""Rows 1-7 and 9-12 of issue 22: bad HF checkpoints, .npy token files, chat templates and chat rows.

Each case used to allocate without bound, hang, load silently or end in a traceback; now it is one
ValueError (the CLIs: one line, exit 2) naming the file and the field or tensor.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from megatron_fp4.config import FP4Config, ModelConfig
from megatron_fp4.integrations.hf import (build_model_from_hf, hf_config_from_ours, load_hf_checkpoint,
                                          save_hf_checkpoint, to_hf_state_dict)
from megatron_fp4.model import MoETransformer, init_weights
from megatron_fp4.training.data import DataError, build_dataset
from megatron_fp4.training.data.chat import ChatTemplateError, render_chat_template

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "1+1?"}]


def _run(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _one_line(proc, *named):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(n in lines[0] for n in named), (named, lines[0])


def _model():
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_seq_len=64, num_experts=4, top_k=2, moe_ffn_hidden_size=32, dense_layers=[1],
                      dense_ffn_hidden_size=48, init_std=0.1)
    model = MoETransformer(cfg, FP4Config(scope="none"))
    init_weights(model, 0)
    return model


@pytest.fixture
def ckpt(tmp_path):
    model = _model()
    return save_hf_checkpoint(model, model.cfg, tmp_path / "hf")


def _edit_config(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------- rows 1-3: config.json


def test_sizes_beyond_the_files_are_refused_before_the_model_is_allocated(ckpt):
    # 2^24 x 2^17 fp32 embedding = 8 TiB: building the model first fails in the allocator (it used to)
    _edit_config(ckpt, vocab_size=1 << 24, hidden_size=1 << 17, num_experts=1 << 14)
    for load in (load_hf_checkpoint, lambda p: build_model_from_hf(p, FP4Config(scope="none"))):
        with pytest.raises(ValueError, match=r"config\.json.*describes another model.*embed_tokens.*\[40, 32\] "
                                             r"vs model \[16777216, 131072\]"):
            load(ckpt)


@pytest.mark.parametrize("field,limit", [("vocab_size", 1 << 24), ("hidden_size", 1 << 17), ("num_experts", 1 << 14),
                                         ("num_local_experts", 1 << 14)])
def test_sizes_beyond_the_sanity_limits_name_config_json(ckpt, field, limit):
    cfg = json.loads((ckpt / "config.json").read_text())
    if field == "num_local_experts":  # the transformers-5 spelling, limited alike
        del cfg["num_experts"]
    cfg[field] = 10**9
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config\.json.*{field}=1000000000: must be an integer in \[1, {limit}\]"):
        load_hf_checkpoint(ckpt)


def test_a_huge_layer_count_is_refused_at_once(ckpt, tmp_path):
    """The layer count used to be looped over before any check (a hang); a subprocess bounds the old code."""
    _edit_config(ckpt, num_hidden_layers=10**12)
    proc = _run(str(REPO / "tools" / "convert_checkpoint.py"), "from-hf", str(ckpt), str(tmp_path / "out"),
                timeout=60)
    _one_line(proc, "config.json", "num_hidden_layers=1000000000000")


@pytest.mark.parametrize("config,field", [
    ([1, 2], "not a JSON object"), ({"num_hidden_layers": [1]}, "num_hidden_layers=[1]"),
    ({"mlp_only_layers": 5}, "mlp_only_layers=5"), ({"rope_theta": "x"}, "rope_theta='x'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}, "rope_theta": [3]}, "rope_theta=[3]"),
    ({"num_experts": "8"}, "num_experts='8'"), ({"layer_types": 3}, "layer_types=3"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"), ({"rms_norm_eps": -1}, "rms_norm_eps=-1"),
])
def test_malformed_config_fields_are_named_with_the_file(ckpt, config, field):
    if isinstance(config, list):
        (ckpt / "config.json").write_text(json.dumps(config))
    else:
        _edit_config(ckpt, **config)
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(ckpt)
    assert str(ckpt / "config.json") in str(err.value) and field in str(err.value), str(err.value)


def test_config_that_is_not_json_names_the_file(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.*cannot read it as JSON"):
        load_hf_checkpoint(ckpt)


# ---------------------------------------------------------------------------- row 4: safetensors files


def _header_file(path: Path, header: dict, data: bytes = b"", declared: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") if declared is None else declared.to_bytes(8, "little"))
    with path.open("ab") as f:
        f.write(raw + data)


def _entry(begin, end, shape=(2,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


def _corrupt(ckpt: Path, kind: str) -> str:
    f = ckpt / "model.safetensors"
    if kind == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
        return "data_offsets"
    if kind == "offsets_beyond_file":
        _header_file(f, {"a": _entry(0, 8), "b": _entry(8, 1 << 40, (1 << 38, 1))}, bytes(16))
        return "within the 16 data bytes"
    if kind == "overlap":
        _header_file(f, {"a": _entry(0, 8), "b": _entry(4, 12)}, bytes(12))
        return "overlaps"
    if kind == "duplicate_keys":
        raw = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, ' \
              b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}'
        f.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(16))
        return "names 'a' twice"
    if kind == "huge_header":
        _header_file(f, {}, declared=100_000_001)
        return "more than the 100000000"
    if kind == "short":
        f.write_bytes(b"\x01\x02")
        return "shorter than the 8-byte header length"
    if kind == "not_json":
        f.write_bytes((5).to_bytes(8, "little") + b"\xff{x:1")
        return "not JSON"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "offsets_beyond_file", "overlap", "duplicate_keys", "huge_header",
                                  "short", "not_json"])
def test_bad_safetensors_files_are_one_error_naming_the_file(ckpt, kind):
    why = _corrupt(ckpt, kind)
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(ckpt)
    msg = str(err.value)
    assert str(ckpt / "model.safetensors") in msg and "not a valid safetensors file" in msg and why in msg, msg


def test_bad_safetensors_file_at_the_cli(ckpt, tmp_path):
    _corrupt(ckpt, "truncated")
    proc = _run(str(REPO / "tools" / "convert_checkpoint.py"), "from-hf", str(ckpt), str(tmp_path / "out"))
    _one_line(proc, str(ckpt / "model.safetensors"))


# ---------------------------------------------------------------------------- rows 5-6: dtypes, shard paths


def test_integer_tensor_for_a_float_weight_is_refused(ckpt):
    sd = {k: v.contiguous().clone() for k, v in load_hf_checkpoint(ckpt)[1].items()}
    sd["model.embed_tokens.weight"] = torch.randint(0, 1 << 30, sd["model.embed_tokens.weight"].shape,
                                                    dtype=torch.int32)
    save_file(sd, str(ckpt / "model.safetensors"))
    for load in (load_hf_checkpoint, lambda p: build_model_from_hf(p, FP4Config(scope="none"))):
        with pytest.raises(ValueError, match=r"non-float tensors .*\(1\): model\.embed_tokens\.weight: I32"):
            load(ckpt)
    from megatron_fp4.integrations.hf import from_hf_state_dict, load_hf_shard
    with pytest.raises(ValueError, match=r"non-float tensors .*model\.embed_tokens\.weight: I32"):
        load_hf_shard(_model(), ckpt)  # a rank loading its part
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: int32"):  # an in-memory state dict
        from_hf_state_dict(_model(), sd)


def _sharded(ckpt: Path, second: str) -> None:
    sd = load_hf_checkpoint(ckpt)[1]
    keys = sorted(sd)
    save_file({k: sd[k].contiguous() for k in keys[:5]}, str(ckpt / "part1.safetensors"))
    (ckpt / "model.safetensors").unlink()
    weight_map = {k: "part1.safetensors" if i < 5 else second for i, k in enumerate(keys)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {k: sd[k].contiguous() for k in keys[5:]}


def test_shard_paths_outside_the_checkpoint_are_refused(ckpt):
    rest = _sharded(ckpt, "../outside.safetensors")
    save_file(rest, str(ckpt.parent / "outside.safetensors"))
    with pytest.raises(ValueError, match=r"'\.\./outside\.safetensors' .* is outside that directory"):
        load_hf_checkpoint(ckpt)
    # the same file reached through a symlink inside the directory
    (ckpt / "link.safetensors").symlink_to(ckpt.parent / "outside.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v.replace("../outside", "link") for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'link\.safetensors' .* is outside that directory"):
        load_hf_checkpoint(ckpt)
    (ckpt / "link.safetensors").unlink()
    (ckpt.parent / "outside.safetensors").rename(ckpt / "link.safetensors")  # inside: loads
    assert len(load_hf_checkpoint(ckpt)[1]) == len(to_hf_state_dict(_model()))


def test_hub_cache_snapshot_links_into_its_blobs_still_load(ckpt, tmp_path):
    """The Hub cache keeps files in ``<repo>/blobs`` and links them from ``<repo>/snapshots/<rev>``."""
    snap = tmp_path / "models--x--y" / "snapshots" / "abc"
    blobs = tmp_path / "models--x--y" / "blobs"
    snap.mkdir(parents=True), blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        (ckpt / name).rename(blobs / name)
        (snap / name).symlink_to(Path("../../blobs") / name)
    assert load_hf_checkpoint(snap)[0] == _model().cfg


# ---------------------------------------------------------------------------- row 7: .npy token files


@pytest.mark.parametrize("kind", ["truncated", "object", "bad_header", "empty", "pickle"])
def test_unreadable_npy_token_files_are_named(tmp_path, kind):
    good = tmp_path / "good.npy"
    np.save(good, np.arange(1000, dtype=np.int32) % 30)
    raw, bad = good.read_bytes(), tmp_path / f"{kind}.npy"
    if kind == "truncated":
        bad.write_bytes(raw[:500])
    elif kind == "object":
        np.save(bad, np.array([1, "a", None], dtype=object), allow_pickle=True)
    elif kind == "bad_header":
        bad.write_bytes(raw[:10] + b"{'descr': garbage" + raw[27:])
    elif kind == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_bytes(b"NOTNUMPY" + raw[8:])
    with pytest.raises(DataError, match=rf"numpy token file '{bad}' is not a readable \.npy array") as err:
        build_dataset({"kind": "numpy", "path": str(bad), "num_samples": 0}, 8, 0, vocab_size=32)
    assert "allow_pickle" not in str(err.value)  # never advise unpickling


# ---------------------------------------------------------------------------- rows 9-11: chat templates


@pytest.mark.parametrize("template,why", [
    # 100000 x 20 iterations: the old renderer finished (slowly); the nested 100000 x 100000 of the issue hung
    ("{% for i in range(100000) %}{% for j in range(20) %}{% endfor %}{% endfor %}", "loop iterations and calls"),
    ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(21) }}",
     "loop iterations and calls"),
    ("{{ 'x' * 2**40 }}", "'*' would exceed"), ("{{ [0] * 2**40 }}", "'*' would exceed"),
    ("{{ 7 ** (2**40) }}", "'**' would exceed"), ("{{ 'x'.ljust(2**40) }}", "ljust()'s argument would exceed"),
    ("{{ 'x'|center(2**40) }}", "center()'s argument would exceed"), ("{{ '%1099511627776d' % 1 }}", "width"),
    ("{{ '{:>1099511627776}'.format(1) }}", "width"), ("{{ '%1099511627776d'|format(1) }}", "width"),
    ("{% set ns = namespace(s='x') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "would exceed"),
    ("{% for i in range(40000) %}{{ 'y' * 1000 }}{% endfor %}", "renders more than"),
])
def test_chat_templates_cannot_do_unbounded_work(template, why):
    with pytest.raises(ChatTemplateError, match=r"the chat template exceeds a limit on its work \(.*" + re.escape(why)):
        render_chat_template(template, MSGS)


@pytest.mark.parametrize("template,why", [
    ("{{ 1/0 }}", "ZeroDivisionError"), ("{{ range(10**6)|list }}", "OverflowError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "refused the messages: no system role"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused the messages"), ("{{ __mfp4_iter }}", "reserved"),
])
def test_failing_chat_templates_are_a_template_error(template, why):
    with pytest.raises(ChatTemplateError, match=why):
        render_chat_template(template, MSGS)


def test_unreadable_chat_template_file_is_named(tmp_path):
    from megatron_fp4.training.data.tokenizer import HFTokenizer

    _tokenizer(tmp_path)
    (tmp_path / "tok" / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ValueError, match=r"tok/chat_template\.jinja: cannot read it as UTF-8 text"):
        HFTokenizer.from_dir(tmp_path / "tok")


def test_bounded_templates_render_as_before():
    template = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ m['role'] ~ '=' ~ m.content }}"
                "{% if not loop.last %},{% endif %}{% else %}none{% endfor %}{{ ('ab' * 3)|upper }}{{ 2 ** 10 }}"
                "{{ '%05d' % 42 }}{{ '{}-{}'.format(1, 2) }}{{ [1] + [2] }}{{ messages|tojson }}")
    msgs = MSGS + [{"role": "assistant", "content": "2"}]
    assert render_chat_template(template, msgs) == ('1/2:user=1+1?,2/2:assistant=2ABABAB102400042'
                                                    '1-2[1, 2]' + json.dumps(msgs))
    # big numbers and format-like text in the data are no sizes: only padding/format widths are bounded
    data = [{"role": "user", "content": " {x:12345678901} %12345678901d ", "ts": 1_700_000_000_000}]
    assert render_chat_template("{{ messages[0].ts|string }}|{{ messages[0].content.strip() }}|"
                                "{{ messages[0].content|trim|center(40) }}", data) == \
        "1700000000000|{x:12345678901} %12345678901d|" + "{x:12345678901} %12345678901d".center(40)


# ---------------------------------------------------------------------------- row 12: message content


def _tokenizer(tmp_path):
    from megatron_fp4.training.data.tokenizer import build_bpe_tokenizer

    return build_bpe_tokenizer(tmp_path / "tok", ["hello world 1+1=2"] * 4)


def test_non_text_message_content_in_preprocess_data(tmp_path):
    _tokenizer(tmp_path)
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": 7}]}) + "\n")
    proc = _run(str(REPO / "tools" / "preprocess_data.py"), "--input", str(rows), "--tokenizer", str(tmp_path / "tok"),
                "--chat-key", "messages", "--output-prefix", str(tmp_path / "out" / "d"))
    _one_line(proc, "row 1", "'messages'", "content'] is a int")
    assert not (tmp_path / "out" / "d_messages_document.bin").exists()


def _rl_row(content):
    return {"data_source": "t", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": "2"}}


def test_non_text_message_content_in_the_rl_dataset(tmp_path):
    from megatron_fp4.rl.tasks.rl_dataset import RLDataset, write_parquet

    tok = _tokenizer(tmp_path)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(_rl_row(7)) + "\n")
    with pytest.raises(ValueError, match=r"row 0 of .*one\.jsonl.*prompt\[0\]\['content'\] is a int \(7\)"):
        RLDataset(one, tok)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(_rl_row("1+1?")) + "\n" + json.dumps(_rl_row(7)) + "\n")
    with pytest.raises(ValueError, match=r"mixed\.jsonl: the rows do not share one column type"):
        RLDataset(mixed, tok)
    write_parquet([_rl_row(7)], tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"row 0 of .*p\.parquet.*content'\] is a int"):
        RLDataset(tmp_path / "p.parquet", tok)
