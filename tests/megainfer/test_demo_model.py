"""The shipped demo checkpoint (megainfer/demo/checkpoint) and the script that trains it."""

from __future__ import annotations

import json
import string
import sys

import pytest
import torch

from megainfer.demo import CHECKPOINT, bpe
from megainfer.engine.engine import Engine
from megainfer.engine_config import EngineConfig
from megainfer.errors import ConfigError
from megainfer.hf_config import from_pretrained
from megainfer.sampling_params import SamplingParams
from tests.helpers import generate_all

transformers = pytest.importorskip("transformers")

PROMPT = "def read_config(path):\n    "
TEXTS = ["def f(x):\n    return x + 1\n", "Caf\u00e9 \u2014 na\u00efve \U0001f600 tabs\tand  spaces\n",
         '"""Docstring."""\nclass A:\n    pass\n']


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.MixtralForCausalLM.from_pretrained(CHECKPOINT)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(CHECKPOINT)


def test_checkpoint_is_small_float32_and_untied():
    size = sum(f.stat().st_size for f in CHECKPOINT.glob("*.safetensors"))
    assert 0 < size < 20 * 2**20
    raw = json.loads((CHECKPOINT / "config.json").read_text())
    assert raw["model_type"] == "mixtral" and raw["dtype"] == "float32" and not raw["tie_word_embeddings"]
    cfg = from_pretrained(CHECKPOINT)
    eos = {bpe.SPECIAL_TOKENS.index(bpe.EOS), bpe.SPECIAL_TOKENS.index(bpe.IM_END)}
    assert set(cfg.eos_token_ids) == eos  # </s> from config.json, <|im_end|> from generation_config.json
    assert (CHECKPOINT / "README.md").read_text().startswith("# megainfer-demo")


def test_engine_greedy_equals_transformers(hf_model, hf_tokenizer):
    ids = hf_tokenizer(PROMPT).input_ids
    expected = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):].tolist()
    engine = Engine(str(CHECKPOINT), EngineConfig(num_kv_blocks=64))
    [got] = generate_all(engine, [PROMPT], SamplingParams(max_tokens=24, temperature=0.0))
    assert got == expected and len(got) > 0


def test_tokenizer_round_trips_and_agrees_with_transformers(hf_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert ids[0] == hf_tokenizer.bos_token_id == raw.token_to_id(bpe.BOS)  # add_bos_token, as trained
        assert hf_tokenizer(text).input_ids == ids
        assert raw.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(raw.encode(TEXTS[0]).ids) < len(TEXTS[0])  # merges learnt: fewer tokens than characters


def test_chat_template_renders_as_in_training(hf_tokenizer):
    messages = [{"role": "user", "content": "Write a function `add`: Add two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Thanks"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == bpe.render_chat(messages, add_generation_prompt=True)
    assert rendered.startswith("<s><|im_start|>user\nWrite a function `add`")
    assert rendered.endswith("Thanks<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids.count(hf_tokenizer.bos_token_id) == 1  # the template's BOS, not a second one


def test_greedy_text_reads_like_python(hf_model, hf_tokenizer):
    ids = hf_tokenizer(PROMPT).input_ids
    out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48)[0, len(ids):].tolist()
    text = hf_tokenizer.decode(out, skip_special_tokens=True)
    assert "\ufffd" not in text and len(text) > 20
    printable = sum(c in string.printable for c in text)
    assert printable / len(text) > 0.95, text
    assert sum(c.isalpha() for c in text) > len(text) / 4, text  # words, not a run of dots or spaces


CORPUS = {
    "shapes.py": '"""Shapes and their areas."""\n\nimport math\n\n\ndef circle_area(r):\n'
                 '    """Return the area of a circle of radius r."""\n    return math.pi * r * r\n\n\n'
                 'def square_area(side):\n    """Return the area of a square."""\n    return side * side\n',
    "words.py": 'def count_words(text):\n    """Count the words in text."""\n    return len(text.split())\n\n\n'
                'class Counter:\n    """Counts things."""\n\n    def add(self, item):\n'
                '        """Add one item."""\n        self.items.append(item)\n',
    "tests/test_skipped.py": "def test_never_read():\n    assert False\n",
}
TINY = ["--steps", "3", "--vocab-size", "300", "--hidden-size", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--experts", "2", "--expert-size", "16", "--seq-len", "32", "--batch-size", "2",
        "--warmup-steps", "1", "--max-position-embeddings", "64", "--threads", "1"]


def test_train_script_runs_end_to_end_and_is_deterministic(tmp_path, capsys):
    from megainfer.tools import demo_train as train

    corpus = tmp_path / "corpus"
    for name, text in CORPUS.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text * 4)
    runs = [tmp_path / "a", tmp_path / "b"]
    threads = torch.get_num_threads()
    try:
        for out in runs:
            assert train.main(["--out", str(out), "--corpus", str(corpus), *TINY]) == 0
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide; later tests keep theirs
    printed = capsys.readouterr().out
    assert "corpus: 2 files" in printed and "step" in printed  # tests/ left out
    a, b = ((out / "model.safetensors").read_bytes() for out in runs)
    assert a == b
    card = (runs[0] / "README.md").read_text()
    assert "3 steps" in card and "--steps 3" in card
    engine = Engine(str(runs[0]), EngineConfig(num_kv_blocks=16))
    [got] = generate_all(engine, ["def "], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(got) == 4
    tok = transformers.AutoTokenizer.from_pretrained(runs[0])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<s><|im_start|>user\nhi<|im_end|>\n"


def test_train_without_transformers_says_how_to_install(tmp_path, monkeypatch):
    from megainfer.tools import demo_train as train

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[test\]"'):
        train.main(["--out", str(tmp_path), "--steps", "1"])
