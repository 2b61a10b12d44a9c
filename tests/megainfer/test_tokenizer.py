from megainfer.tokenizer import ByteTokenizer, IncrementalDetokenizer


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
