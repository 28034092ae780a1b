"""tools/train/train_tiny.py and its parts (corpus, MTP head, evaluation) at toy scale on a fake standard library."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from hkv.models.loader import describe_model, load_model
from tools.train import tiny_eval, train_tiny
from tools.train.tiny_corpus import load_corpus
from tools.train.tiny_mtp import MTPHead, window_forward

FUNCS = '''\
import os


def area(width, height):
    """Return the area of a rectangle."""
    return width * height


class Box:
    def volume(self, depth):
        """The volume of the box,
        in cubic units."""
        return self.width * self.height * depth
'''


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    """A fake standard library: two packages to hold out, their tests, and what must be skipped."""
    root = tmp_path_factory.mktemp("stdlib")
    files = {
        "abc.py": FUNCS, "zipapp.py": FUNCS.replace("area", "zone"), "json/__init__.py": FUNCS,
        "json/decoder.py": "x = 1\n", "email/utils.py": FUNCS, "test/test_json/test_x.py": "y = 2\n",
        "test/test_email.py": "z = 3\n", "test/test_os.py": FUNCS, "site-packages/pkg.py": "w = 4\n",
        "__pycache__/abc.py": "v = 5\n", "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8
    return root


def test_the_corpus_holds_packages_and_their_tests_out(stdlib):
    corpus = load_corpus(stdlib, ("json", "email"))
    assert [f.path for f in corpus.train] == ["abc.py", "test/test_os.py", "zipapp.py"]
    assert [f.path for f in corpus.held_out] == ["email/utils.py", "json/__init__.py", "json/decoder.py"]
    assert sorted(corpus.skipped) == ["latin.py", "test/test_email.py", "test/test_json/test_x.py"]
    assert load_corpus(stdlib, ("json", "email"), max_files=2).train == (corpus.train[0], corpus.train[2])
    summary = corpus.summary()
    assert summary["train_files"] == 3 and summary["held_out_bytes"] == len(FUNCS) * 2 + 6


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    args = argparse.Namespace(lr=1e-3, warmup=10, steps=110)
    assert train_tiny.lr_at(0, args) == pytest.approx(1e-4)
    assert train_tiny.lr_at(9, args) == pytest.approx(1e-3)
    assert train_tiny.lr_at(60, args) == pytest.approx(0.55e-3)
    assert train_tiny.lr_at(110, args) == pytest.approx(1e-4)


def test_kneser_ney_bigram_is_a_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    train = torch.randint(0, vocab - 1, (200,), generator=gen)  # token 6 never seen
    model = tiny_eval.KneserNeyBigram(train, vocab)
    for prev in range(vocab):
        p = model.prob(torch.full((vocab,), prev), torch.arange(vocab))
        assert float(p.sum()) == pytest.approx(1.0) and bool((p > 0).all())
    assert model.bits(torch.tensor([1, 2])) == pytest.approx(-torch.log2(model.prob(torch.tensor([1]),
                                                                                  torch.tensor([2]))).item())


def test_byte_bigram_of_unseen_text_costs_eight_bits_a_byte():
    assert tiny_eval.byte_bigram_bits(b"a", b"xyz") == pytest.approx(24.0)


def test_headers_are_dedented_and_cut_where_the_function_ends():
    from tools.train.tiny_corpus import SourceFile

    headers = tiny_eval.find_headers((SourceFile("m.py", FUNCS),), count=5)
    assert [(h.name, h.line) for h in headers] == [("area", 4), ("volume", 10)]
    assert headers[1].prompt == 'def volume(self, depth):\n    """The volume of the box,\n'
    body = '        in cubic units."""\n    return 1\n\nclass Next:\n'
    cut, ended = tiny_eval.cut_function(headers[1].prompt, body, finished=False)
    assert ended and cut == headers[1].prompt + '        in cubic units."""\n    return 1\n\n'
    assert tiny_eval.is_valid(cut)
    cut, ended = tiny_eval.cut_function(headers[0].prompt, "    return (wid", finished=False)
    assert not ended and cut == headers[0].prompt


def _small_model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = train_tiny.model_config(64, 0, 2) | dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                                       layer_types=train_tiny.LAYER_TYPES, head_dim=16,
                                                       linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_dict(config)).eval()
    return model, MTPHead(model.config).eval()


def test_the_mtp_head_is_causal_and_predicts_the_token_after_next():
    model, mtp = _small_model()
    window = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = window.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # only the last target changes
    with torch.no_grad():
        out, again = window_forward(model, mtp, window), window_forward(model, mtp, changed)
    assert out.nll.shape == out.mtp_nll.shape == (2, 10)
    assert torch.equal(out.nll, again.nll)  # the target never reads its targets
    assert torch.equal(out.mtp_nll[:, :-1], again.mtp_nll[:, :-1]) and not torch.equal(out.mtp_nll, again.mtp_nll)
    changed = window.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 64  # an input: only later positions may move
    with torch.no_grad():
        moved = window_forward(model, mtp, changed)
    assert torch.equal(out.mtp_nll[:, :3], moved.mtp_nll[:, :3])


def test_a_toy_run_writes_a_folder_hkv_serves_and_eval_reads(stdlib, tmp_path, capsys):
    out = tmp_path / "model"
    common = ["--stdlib", str(stdlib), "--device", "cpu", "--threads", "1"]
    train_tiny.main(["--out", str(out), *common, "--steps", "2", "--batch", "2", "--seq", "16", "--vocab", "300",
                     "--warmup", "1", "--log-every", "1", "--val-every", "1", "--val-windows", "2"])
    written = {p.name for p in out.iterdir()}
    assert written >= {*train_tiny.SERVING_FILES, "digests.json", "loss.json", "train_info.json"}
    info = json.loads((out / "train_info.json").read_text())
    assert info["steps_run"] == 2 and info["seed"] == 0 and info["corpus"]["held_out_packages"] == [
        "json", "email", "http", "tomllib"]
    assert describe_model(out).vocab_size == 300
    load_model(out, "float32", "cpu")  # hkv loads it, skipping mtp.*
    train_tiny.main(["--eval", "--model", str(out), *common, "--headers", "2", "--gen-tokens", "3"])
    report = json.loads((out / "eval.json").read_text())
    assert report["held_out_packages"] == info["corpus"]["held_out_packages"]
    assert len(report["headers"]) == 2 and report["bpb"]["model_bpb"] > 0
    assert "token bigram, Kneser-Ney" in capsys.readouterr().out
    digests = json.loads((out / "digests.json").read_text())
    assert set(digests) == set(train_tiny.SERVING_FILES)


def test_training_needs_an_output_folder():
    with pytest.raises(SystemExit):
        train_tiny.parse_args([])


def test_every_flag_has_help_with_its_default():
    actions = [a for a in train_tiny.build_parser()._actions if a.option_strings and a.dest != "help"]
    for action in actions:
        assert action.help, action.dest
        if action.default not in (None, False):
            assert re.search(r"\(default: [^)]+\)", action.help), action.dest
