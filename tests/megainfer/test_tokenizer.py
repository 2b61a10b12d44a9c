import json

import pytest

from megainfer.errors import CheckpointError
from megainfer.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer
from tests.tokenizer_checkpoints import write_llama_style_tokenizer, write_qwen_style_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(258)
    ids = tok.encode("héllo ✓")
    assert ids[0] == ByteTokenizer.BOS
    assert tok.decode(ids) == "héllo ✓"


def test_incremental_detokenizer_holds_back_partial_characters():
    tok = ByteTokenizer(258)
    text = "a✓b é"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert pieces[1] == "" and pieces[2] == "" and pieces[3] == "✓"  # three bytes, one character


def test_flush_emits_an_unfinished_character_as_replacement():
    detok = IncrementalDetokenizer(ByteTokenizer(258))
    assert detok.add([0xE2, 0x9C]) == ""
    assert detok.flush() == "\ufffd"


def test_byte_tokenizer_adds_bos_only_when_asked_and_names_its_special_tokens():
    tok = ByteTokenizer(258)
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]
    assert tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    ids = [256, *"é".encode(), 257]
    assert tok.decode(ids) == "é" and tok.decode(ids, skip_special_tokens=False) == "<s>é</s>"
    assert tok.token_text(257) == "</s>" and tok.token_text(104) == "h"


def test_incremental_detokenizer_keeps_special_tokens_when_asked():
    ids = [256, *b"ok", 257]
    kept = IncrementalDetokenizer(ByteTokenizer(258), skip_special_tokens=False)
    skipped = IncrementalDetokenizer(ByteTokenizer(258))
    assert "".join(kept.add([i]) for i in ids) + kept.flush() == "<s>ok</s>"
    assert "".join(skipped.add([i]) for i in ids) + skipped.flush() == "ok"


TEXTS = ["Hello world", "  leading spaces and\nnew lines\n", "naïve café ✓ 你好", "<s>hi</s> there <|im_end|>",
         "<|im_start|>user\nhi<|im_end|>\n<think>x", "x", ""]


def _same_as_transformers(directory):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(directory)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids == (ref.eos_token_id,)
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    return ours


@pytest.mark.parametrize("config", [{}, {"add_bos_token": False}, {"tokenizer_class": "PreTrainedTokenizerFast"},
                                    {"split_special_tokens": True}])
def test_llama_style_tokenizer_matches_transformers(tmp_path, config):
    ours = _same_as_transformers(write_llama_style_tokenizer(tmp_path, **config))
    # Mixtral's tokenizer.json prepends <s>; transformers 5 takes that over add_bos_token.
    assert ours.encode("Hello")[0] == ours.bos_token_id == 1
    assert ours.encode("Hello", add_special_tokens=False)[0] != 1


def test_tokenizer_json_without_post_processor_adds_no_bos(tmp_path):
    write_llama_style_tokenizer(tmp_path, add_bos_token=True)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    ours = _same_as_transformers(tmp_path)
    assert 1 not in ours.encode("Hello")


def test_qwen_style_tokenizer_matches_transformers(tmp_path):
    ours = _same_as_transformers(write_qwen_style_tokenizer(tmp_path))
    assert ours.bos_token_id is None
    assert ours.encode("Hi") == ours.encode("Hi", add_special_tokens=False)  # Qwen adds no BOS
    im_end = ours.eos_token_ids[0]
    assert ours.encode("a<|im_end|>")[-1] == im_end
    assert ours.token_text(im_end) == "<|im_end|>" and ours.decode([im_end]) == ""
    assert [ours.token_text(i) for i in ours.encode("Hello world")] == ["Hello", " world"]


def test_special_tokens_named_only_in_tokenizer_config_are_added(tmp_path):
    write_qwen_style_tokenizer(tmp_path, additional_special_tokens=["<|im_start|>", "<|im_end|>", "<tool_call>"])
    ours = _same_as_transformers(tmp_path)
    tool = ours.encode("<tool_call>")
    assert len(tool) == 1 and ours.decode(tool) == "" and ours.decode(tool, skip_special_tokens=False) == "<tool_call>"


def test_incremental_detokenizer_matches_decode_on_a_byte_level_tokenizer(tmp_path):
    tok = HFTokenizer(write_qwen_style_tokenizer(tmp_path))
    text = "naïve café — ✓ 你好 <|im_end|> done"
    ids = tok.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_unknown_special_token_in_config_is_a_checkpoint_error(tmp_path):
    write_qwen_style_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        HFTokenizer(tmp_path)
    config["added_tokens_decoder"] = ["<x>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="added_tokens_decoder"):
        HFTokenizer(tmp_path)


def test_byte_level_tokenizers_stream_by_bytes_and_others_by_windows(tmp_path):
    qwen = HFTokenizer(write_qwen_style_tokenizer(tmp_path / "qwen"))
    llama = HFTokenizer(write_llama_style_tokenizer(tmp_path / "llama"))
    assert IncrementalDetokenizer(qwen)._bytes is not None  # ByteLevel decoder: concatenation
    assert IncrementalDetokenizer(llama)._bytes is None  # Metaspace, byte fallback, strip: windows


@pytest.mark.parametrize("skip", [True, False])
def test_the_byte_path_equals_decode_on_random_ids_special_tokens_and_broken_utf8_included(tmp_path, skip):
    """Any ids, not only what a text encodes to: a model may sample half a character, a special
    token or bytes that are not UTF-8 at all. Streamed and flushed, the text is decode's."""
    import random

    tok = HFTokenizer(write_qwen_style_tokenizer(tmp_path, additional_special_tokens=["<|im_start|>", "<|im_end|>"]))
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = [detok.add([i]) for i in ids]
        assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip), ids
        # The engine's one-token path (a table lookup where nothing is pending) gives the same pieces.
        one = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        assert [one.add_one(i) for i in ids] == pieces, ids
    table = tok.token_texts(skip)
    assert any(t is None for t in table) and sum(t is not None for t in table) > tok.vocab_size // 2
