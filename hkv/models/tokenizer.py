"""Tokenizer of an HF checkpoint folder: tokenizer.json through `tokenizers`, chat template through jinja2.

The chat template is rendered the way transformers renders it (sandboxed,
trim_blocks/lstrip_blocks, `tojson` without HTML escaping, `raise_exception`),
so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(ValueError):
    """The folder lacks what the tokenizer needs (tokenizer.json, a chat template when one is asked for)."""


def read_json(path: Path) -> dict:
    """A JSON object from `path`, {} when the file does not exist; TokenizerError when it is not valid JSON."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def _id_list(value: object) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def checkpoint_eos_ids(folder: Path) -> tuple[int, ...]:
    """End-of-sequence ids declared by generation_config.json, then config.json (and its text_config)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        d = read_json(Path(folder, name))
        ids += _id_list(d.get("eos_token_id"))
        ids += _id_list((d.get("text_config") or {}).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _token_text(value: object) -> str | None:
    """tokenizer_config.json names special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _find_chat_template(folder: Path, tok_config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        # the older multi-template form: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore names, which could reach interpreter internals."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick keeps `self` out of kwargs)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore names ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which changes prompts
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def tool_call_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches: "qwen3_coder" (Qwen3-Coder's and Qwen3.5's XML),
    "hermes" (Qwen2.5's and Qwen3's <tool_call> JSON), or None (hkv/openai/chat_output.py parses both)."""
    if not template:
        return None
    if "<function=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    return None


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox with transformers' filters and globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids and chat rendering for one checkpoint folder."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
        special_tokens: dict[str, str],
    ) -> None:
        self.backend: tokenizers.Tokenizer = backend
        self.chat_template: str | None = chat_template
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.special_tokens: dict[str, str] = special_tokens  # bos_token/eos_token/... -> text, when declared
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        # one past the largest id the tokenizer can produce, added tokens included
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        tok_config = read_json(folder / "tokenizer_config.json")
        special = {key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(tok_config.get(key)))}
        eos = list(checkpoint_eos_ids(folder))
        eos_text_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_text_id is not None:
            eos.append(eos_text_id)
        return cls(backend, _find_chat_template(folder, tok_config), tuple(dict.fromkeys(eos)), special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt text.

        Keys whose value is None are dropped (templates test for presence). Extra keyword
        arguments (e.g. tools, enable_thinking) reach the template as variables.
        Raises TokenizerError without a template, jinja2.TemplateError when the template refuses.
        """
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **template_kwargs}
        return self._compiled.render(messages=cleaned, add_generation_prompt=add_generation_prompt, **variables)
