"""An HF model directory's tokenizer, with the `tokenizers` library and no transformers.

    tok = HFTokenizer.from_dir("path/to/Qwen3-30B-A3B")        # tokenizer.json + tokenizer_config.json
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True)
    engine = RolloutEngine(model, pad_id=tok.pad_id)
    params = SamplingParams(stop_token_ids=tok.stop_token_ids)

Files read (what ``save_pretrained`` writes): ``tokenizer.json`` (the `tokenizers` pipeline,
required), ``tokenizer_config.json`` (special tokens, ``chat_template``), ``chat_template.jinja``
(newer transformers keep the template there), ``special_tokens_map.json`` (legacy special tokens)
and ``generation_config.json`` (its ``eos_token_id`` list: extra stop tokens, as Qwen ships
``<|im_end|>`` and ``<|endoftext|>``). All are JSON or text; nothing in the directory executes
(``auto_map`` / custom tokenizer classes are ignored).

Token ids are those of transformers' fast tokenizer for the same directory: ``encode`` runs
`tokenizers` with the post-processor (bos/eos framing) when ``add_special_tokens``; chat prompts are
encoded without it, as ``apply_chat_template`` does. A tokenizer without a pad token pads with eos
(verl's ``set_pad_token_id``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from megatron_fp4.training.data.chat import render_chat_template

__all__ = ["HFTokenizer", "SPECIAL_TOKEN_KEYS", "CHATML_TEMPLATE", "build_bpe_tokenizer"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read it as JSON ({err}); is the tokenizer directory complete?") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value) -> Optional[str]:
    """A special token as stored: a string, or an AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token {value!r} is neither a string nor an AddedToken dict with 'content'")


def _pick_template(value, name: str = "default") -> Optional[str]:
    """``chat_template`` is a string or a list of ``{"name", "template"}`` (transformers' named templates)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if name in named:
            return named[name]
        raise ValueError(f"chat_template has the named templates {sorted(named)}, none called {name!r}; "
                         "pass template_name=")
    raise ValueError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


class HFTokenizer:
    """`tokenizers.Tokenizer` plus the special tokens and chat template of an HF tokenizer directory."""

    def __init__(self, tokenizer, special_tokens: dict, chat_template: Optional[str] = None,
                 extra_eos_ids: Sequence[int] = (), name: str = "tokenizer"):
        self.tokenizer = tokenizer
        self.name = name
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self.bos_id = self._id_of("bos_token")
        self.eos_id = self._id_of("eos_token")
        pad = self._id_of("pad_token")
        self.pad_id = pad if pad is not None else self.eos_id
        stops = [self.eos_id] if self.eos_id is not None else []
        self.stop_token_ids = tuple(dict.fromkeys(stops + [int(i) for i in extra_eos_ids]))

    @classmethod
    def from_dir(cls, path, template_name: str = "default") -> "HFTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json: point data.tokenizer at an HF model directory saved by a "
                             "fast tokenizer (tokenizer.save_pretrained); slow-only tokenizers (vocab.txt, "
                             "*.model) are not supported")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # tokenizers raises its own Exception type for a malformed file
            raise ValueError(f"{tokenizer_file}: the tokenizers library cannot load it ({err})") from None
        config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        legacy = _read_json(path / "special_tokens_map.json") if (path / "special_tokens_map.json").is_file() else {}
        special = {k: _token_text(config.get(k, legacy.get(k))) for k in SPECIAL_TOKEN_KEYS}
        template = _pick_template(config.get("chat_template"), template_name)
        if (path / "chat_template.jinja").is_file():
            try:
                template = (path / "chat_template.jinja").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"{path / 'chat_template.jinja'}: cannot read it as UTF-8 text ({err})") from None
        extra = []
        if (path / "generation_config.json").is_file():
            eos = _read_json(path / "generation_config.json").get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
        return cls(tokenizer, special, template, extra, name=str(path))

    def _id_of(self, key: str) -> Optional[int]:
        text = self.special_tokens.get(key)
        if text is None:
            return None
        token_id = self.tokenizer.token_to_id(text)
        if token_id is None:
            raise ValueError(f"{self.name}: {key}={text!r} is not in the vocabulary of tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Ids run 0..vocab_size-1, added tokens included (the model's embedding needs at least this)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True, stop_at_eos: bool = False) -> str:
        """Text of `ids` (a list or tensor); with `stop_at_eos`, everything from the first stop token on is cut."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if stop_at_eos:
            cut = [k for k, i in enumerate(ids) if i in self.stop_token_ids]
            ids = ids[:cut[0]] if cut else ids
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """Token ids (or with ``tokenize=False`` the text) of `messages`, as transformers renders them."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template (no chat_template in tokenizer_config.json and no "
                             "chat_template.jinja); add one or encode plain text with encode()")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt, self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# A ChatML template (the Qwen family's turn format, without its tool and thinking branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_bpe_tokenizer(out_dir, texts: Sequence[str], vocab_size: int = 320, chat_template: str = CHATML_TEMPLATE,
                        special_tokens: Sequence[str] = CHATML_SPECIAL, eos_token: str = "<|im_end|>",
                        pad_token: str = "<|endoftext|>") -> HFTokenizer:
    """Train a byte-level BPE on `texts` (all 256 bytes in the vocabulary, so any text encodes; digits
    split one per token, as Qwen and Llama do) and save it
    HF-style in `out_dir` (tokenizer.json + tokenizer_config.json, loadable by transformers'
    AutoTokenizer); returns it loaded back with `HFTokenizer.from_dir`. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "bos_token": None,
              "eos_token": eos_token, "pad_token": pad_token, "chat_template": chat_template,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return HFTokenizer.from_dir(out)
