import json
import shutil
from pathlib import Path

import jinja2
import pytest

from hkv.models.tiny import ensure_builtin
from hkv.models.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return ensure_builtin("tiny-dense", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(folder) -> Tokenizer:
    return Tokenizer.from_folder(folder)


def _variant(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "variant"))


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café, Straße, ¿Qué tal?",
        "敏捷的棕色狐狸 こんにちは 안녕하세요 Привет مرحبا",
        "emoji 😀🎉🦊👩‍👩‍👧 ❤️ and a rare one: 🫠 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_vocab_special_ids_and_eos(tok):
    assert tok.vocab_size == 1536
    assert tok.special_ids == {0, 1, 2}
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # generation_config.json lists [<|im_end|>, <|endoftext|>]; tokenizer_config's eos repeats <|im_end|>
    assert tok.eos_token_ids == (2, 0)


def test_special_tokens_encode_as_one_id_and_skip_on_decode(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_output(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there 😀"}]},
        {"role": "assistant", "content": "Hello!", "tool_calls": None},
        {"role": "user", "content": "Bye"},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there 😀<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages) == want
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == want.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_matches_transformers(folder, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "What is 2+2? Ünïcödé ✨"}, {"role": "assistant", "content": "4"}]
    for gen in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)


def _set_template(folder: Path, template: str | None) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    path.write_text(json.dumps(config))


def test_template_file_helpers_and_sandbox(folder, tmp_path):
    variant = _variant(folder, tmp_path)
    _set_template(variant, None)
    (variant / "chat_template.jinja").write_text(
        "{{ messages | tojson }}{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    tok = Tokenizer.from_folder(variant)
    # tojson keeps non-ASCII and HTML characters as they are, like transformers
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == (
        '[{"role": "user", "content": "<b>é</b>"}]'
    )
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    (variant / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_folder(variant).apply_chat_template([])
    (variant / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_folder(variant).apply_chat_template([])


def test_missing_tokenizer_or_template(folder, tmp_path):
    variant = _variant(folder, tmp_path)
    _set_template(variant, None)
    tok = Tokenizer.from_folder(variant)
    assert tok.encode("still works") != []
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    (variant / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_folder(variant)


def test_eos_from_config_when_no_generation_config(folder, tmp_path):
    variant = _variant(folder, tmp_path)
    (variant / "generation_config.json").unlink()
    config = json.loads((variant / "config.json").read_text())
    config["eos_token_id"] = [0]
    (variant / "config.json").write_text(json.dumps(config))
    # config.json's id first, then tokenizer_config's eos_token (<|im_end|>)
    assert Tokenizer.from_folder(variant).eos_token_ids == (0, 2)
