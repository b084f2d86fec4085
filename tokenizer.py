"""Text <-> token ids: the Tokenizer, built from an HF folder or from GGUF metadata.

From an HF folder: tokenizer.json (with `tokenizers`) or tokenizer.model (with `sentencepiece`),
special tokens from tokenizer_config.json, EOS ids from generation_config.json, the chat template
from tokenizer_config.json or chat_template.jinja. From GGUF metadata (tokenizer.ggml.*): the
byte-level or sentencepiece BPE vocabulary rebuilt with `tokenizers`, as llama.cpp reads it.

Chat templates are untrusted code from the model's files: they render in jinja2's immutable
sandbox. LoadError is defined here because loading.py imports this module, never the reverse.
"""

from __future__ import annotations

import json
import re
import warnings
from datetime import datetime
from pathlib import Path


class LoadError(ValueError):
    """A checkpoint or tokenizer that cannot be loaded; the message says which file and what to do."""


def read_json(path: Path) -> dict:
    """A JSON file of a model folder; a missing or corrupt file is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; a model folder needs it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e}); the file is corrupt, download it again") from e


# ---------------------------------------------------------------------------------------------
# GGUF vocabularies, rebuilt with `tokenizers`


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in:
    printable Latin-1 bytes stand for themselves, the rest take the code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# How a byte-level vocabulary splits text before BPE, by tokenizer.ggml.pre (llama.cpp's names).
# Each entry is a list of regexes applied in turn; the last one is the word split.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    # digits one by one, then GPT-2's split (these vocabularies were trained so)
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def _gguf_added_tokens(meta: dict, spelled=lambda token: True) -> list:
    """Control tokens (<|im_start|>, <s> ...) as special tokens and user-defined ones as plain added
    tokens: both are matched whole in text, as llama.cpp does."""
    from tokenizers import AddedToken

    kinds = meta.get("tokenizer.ggml.token_type", [])
    return [AddedToken(t, special=kind == _GGUF_TOKEN_CONTROL, normalized=False)
            for t, kind in zip(meta["tokenizer.ggml.tokens"], kinds)
            if kind in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED) and spelled(t)]


def _byte_level_from_gguf(meta: dict, where: str):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # vocabularies are stored in the byte alphabet; respell the odd token that is not
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        warnings.warn(f"{where}: unknown tokenizer.ggml.pre {pre!r}; splitting text like GPT-2, so token ids "
                      f"may differ from the original tokenizer's")
    splits = _PRE_SPLITS.get(pre, [_GPT2_SPLIT])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # a "control" token outside the byte alphabet is a mislabelled piece of text, not a marker
    tok.add_tokens(_gguf_added_tokens(meta, spelled=lambda t: set(t) <= letters))
    return tok


def _sentencepiece_bpe_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece BPE vocabulary implies: every split of a piece into two pieces,
    best-scored result first (sentencepiece merges the highest-scoring piece it can form)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _sentencepiece_bpe_from_gguf(meta: dict):
    """A sentencepiece BPE vocabulary (tokenizer.ggml.model "llama": Llama-2, Mistral) rebuilt with
    `tokenizers`: the ▁ word marker, byte fallback for unknown characters, merges from the file
    or, when it has none, from the piece scores (higher score = merged earlier)."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _sentencepiece_bpe_merges(tokens, meta["tokenizer.ggml.scores"])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # spaces become ▁ and, unless the file says not to, every run of text between special tokens gets a
    # leading ▁: what sentencepiece and llama.cpp do, including for text that starts with spaces
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    marks = [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(marks if space_prefix else marks[1:])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    tok.add_tokens(_gguf_added_tokens(meta))
    return tok


# ---------------------------------------------------------------------------------------------
# Backends: the library that turns text into ids


class _TokenizersBackend:
    """A `tokenizers` tokenizer, used without its post-processor: BOS is the Tokenizer's decision."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def adds_bos(self, bos_id: int | None) -> bool:
        """Whether the tokenizer.json post-processor puts BOS in front."""
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        return bos_id is not None and with_special[:1] == [bos_id] and self.encode("a")[:1] != [bos_id]


class _SentencePieceBackend:
    """A sentencepiece tokenizer.model. sentencepiece never matches control pieces (<s>, </s>) in text,
    so text is cut at them first and each piece encoded alone, as HF's slow (legacy) tokenizer does."""

    def __init__(self, path: Path, extra_special: list[str]):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.special = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())
                        if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self.special.update({t: i for t in extra_special if (i := self.token_to_id(t)) is not None})
        alternatives = sorted(self.special, key=len, reverse=True)
        self.cut = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in (self.cut.split(text) if self.cut else [text]):
            if part in self.special:
                ids.append(self.special[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        special_ids = set(self.special.values())
        out, run = [], []
        for i in ids:  # sentencepiece drops control ids when decoding; keep them unless asked not to
            if i in special_ids:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)  # unknown pieces come back as the unk id
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def adds_bos(self, bos_id: int | None) -> bool:
        return bos_id is not None  # LlamaTokenizer's default


# ---------------------------------------------------------------------------------------------
# The Tokenizer


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Tokenizer:
    """Text <-> token ids, the model's BOS/EOS ids and its chat template.

    encode() adds BOS exactly when HF's tokenizer for this model does (add_bos_token of
    tokenizer_config.json, else the tokenizer.json post-processor; for GGUF tokenizer.ggml.add_bos_token).
    Text rendered by apply_chat_template already holds what the template wants: encode it with
    add_bos=False, as HF does.
    """

    def __init__(self, backend: _TokenizersBackend | _SentencePieceBackend, bos_token: str | None,
                 eos_token: str | None, add_bos: bool, extra_eos_ids: list[int], chat_template: str | None):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.eos_ids: set[int] = set(extra_eos_ids) | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos and self.bos_id is not None
        self.chat_template = chat_template
        self._compiled_template = None

    # -- construction

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """From an HF folder: tokenizer.json (or tokenizer.model), tokenizer_config.json,
        chat_template.jinja, generation_config.json."""
        config_path = folder / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            backend = _TokenizersBackend(HFTokenizer.from_file(str(folder / "tokenizer.json")))
        elif (folder / "tokenizer.model").is_file():
            added = [_token_text(t) for t in config.get("added_tokens_decoder", {}).values()]
            backend = _SentencePieceBackend(folder / "tokenizer.model", added)
        else:
            raise FileNotFoundError(f"{folder}: no tokenizer; expected tokenizer.json or tokenizer.model there")

        model_config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        gen_path = folder / "generation_config.json"
        generation = read_json(gen_path) if gen_path.is_file() else {}

        def special(name: str) -> str | None:
            text = _token_text(config.get(f"{name}_token"))
            if text is None:  # fall back to the model's ids
                ids = _as_ids(generation.get(f"{name}_token_id", model_config.get(f"{name}_token_id")))
                text = backend.id_to_token(ids[0]) if ids else None
            return text

        bos, eos = special("bos"), special("eos")
        bos_id = backend.token_to_id(bos) if bos else None
        add_bos = config["add_bos_token"] if "add_bos_token" in config else backend.adds_bos(bos_id)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, bos, eos, bool(add_bos), _as_ids(generation.get("eos_token_id")), template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, where: str = "GGUF") -> Tokenizer:
        """From GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2") or sentencepiece BPE ("llama")."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = _byte_level_from_gguf(meta, where)
        elif kind == "llama":
            tok = _sentencepiece_bpe_from_gguf(meta)
        else:
            raise LoadError(f"{where}: tokenizer model {kind!r} is not supported (gpt2 and llama are)")
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None else None

        # llama.cpp also stops on the end-of-turn / end-of-message tokens when the file names them
        extra_eos = [meta[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if key in meta]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(_TokenizersBackend(tok), token("bos"), token("eos"), add_bos, extra_eos,
                   meta.get("tokenizer.chat_template"))

    # -- use

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos=None follows the model's tokenizer (see the class doc).
        Special-token text such as <|im_start|> becomes its id."""
        ids = self.backend.encode(text)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise LoadError("this tokenizer has no BOS token to add")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation as the model expects it, rendered with the model's jinja template in a sandbox."""
        if self.chat_template is None:
            raise LoadError("this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
                            "or the GGUF metadata); use plain generation instead of chat")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


# ---------------------------------------------------------------------------------------------
# Chat templates


def _compile_template(source: str):
    """Chat templates are untrusted code from the model's files: jinja2's immutable sandbox, with the
    helpers HF templates expect (raise_exception, strftime_now, a tojson that keeps non-ASCII)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
