"""HFTokenizer and chat templates against transformers' own tokenizer for the same directory.

A small byte-level BPE is trained at test time with `tokenizers` and saved HF-style (nothing is
downloaded); transformers' AutoTokenizer loads the same files. Token ids, decoded text, rendered
chat templates and special-token ids must be identical (exact equality: both run the same
`tokenizers` pipeline and the same Jinja source, there is no numeric tolerance involved).
"""
import json

import pytest

from megatron_fp4.training.data.chat import ChatTemplateError, render_chat_template
from megatron_fp4.training.data.tokenizer import CHATML_TEMPLATE, HFTokenizer, build_bpe_tokenizer

import transformers  # the test extra installs it: a missing package fails, never skips

CORPUS = ["What is 12 + 7? Put the final answer after ####.", "Tom has 3 apples and gets 4 more.\n3+4=7\n#### 7",
          "Ann had 20 pears and gave away 5.\n20-5=15\n#### 15", "The answer is \\boxed{42}."] * 8
TEXTS = ["What is 12 + 7?", "  leading spaces and ümlauts ✓", "#### 1,234", "", "<|im_start|>user\nhi<|im_end|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"},
     {"role": "assistant", "content": "3+4=7\n#### 7"}, {"role": "user", "content": "and 5+5?"}],
]
# A template in the style of real ones: bos variable, namespace, loop controls, tojson, raise_exception.
RICH_TEMPLATE = (
    "{{ bos_token or '' }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}|{{ m.role }}]{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_bpe_tokenizer(path, CORPUS, vocab_size=300)
    return path


@pytest.fixture(scope="module")
def pair(tok_dir):
    return HFTokenizer.from_dir(tok_dir), transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _ids(out):
    """transformers >= 5 returns a BatchEncoding from apply_chat_template(tokenize=True)."""
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_encode_decode_and_special_ids_match_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id)
    assert ours.vocab_size == len(hf) and ours.stop_token_ids == (hf.eos_token_id,)
    assert len(ours.encode("What is 12 + 7?")) < len("What is 12 + 7?")  # merges happened


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(pair, conv, generation_prompt):
    ours, hf = pair
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    assert ids == _ids(hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))
    assert text.endswith("<|im_start|>assistant\n") == generation_prompt


def test_rich_template_file_and_added_token_dicts(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json (as in transformers); AddedToken dicts,
    special variables, loop controls, tojson and the tools argument render identically."""
    build_bpe_tokenizer(tmp_path, CORPUS, vocab_size=300)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    config["bos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ours, hf = HFTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tools = [{"name": "calc", "description": "adds <numbers> & more"}]
    for messages in CONVERSATIONS:
        for kwargs in ({}, {"tools": tools}):
            want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs) == want
    assert ours.bos_id == hf.bos_token_id and "<|endoftext|>[1|user]" in want and '"adds <numbers> & more"' in want
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_pad_falls_back_to_eos_and_generation_config_adds_stop_ids(tmp_path):
    build_bpe_tokenizer(tmp_path, CORPUS, vocab_size=300)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.pad_id == tok.eos_id == 2 and tok.stop_token_ids == (2, 0)
    ids = tok.encode("3+4=7") + [0] + tok.encode(" junk")
    assert tok.decode(ids, stop_at_eos=True) == "3+4=7"


def test_template_sandbox_and_errors(tmp_path, pair):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render_chat_template(escape, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        pair[0].apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    assert render_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
