"""Stop strings over streamed text: truncation, the stop string kept on request, hold-back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from megainfer.engine.stop_strings import StopStrings


def stream(stops, pieces, include=False, final=True):
    matcher = StopStrings(stops, include)
    shown = [matcher.add(p, final=final and i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return shown, matcher.stop_string


def reference(text, stops, include):
    """The text as it should end: cut where a stop string first completes."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found, key=lambda f: (f[0], f[1]))
    return text[:end if include else start], stop


def test_text_ends_before_a_stop_string_spanning_pieces():
    shown, stop = stream(["STOP"], ["ab", "cS", "TO", "Px", "yz"])
    assert "".join(shown) == "abc" and stop == "STOP"
    assert shown == ["ab", "c", "", "", ""]  # "S" and "TO" were held back, never shown


def test_include_stop_str_in_output_keeps_it_and_holds_nothing():
    shown, stop = stream(["STOP"], ["ab", "cS", "TO", "Px"], include=True)
    assert shown == ["ab", "cS", "TO", "P"] and stop == "STOP"


def test_held_text_is_released_when_it_cannot_start_a_stop_string():
    matcher = StopStrings(["F6x"])
    assert matcher.add("F") == ""
    assert matcher.add("F") == "F"
    assert matcher.add("6") == ""  # "F6" may still become "F6x"
    assert matcher.add("6") == "F66"
    assert matcher.add("F", final=True) == "F"  # the end releases what is held
    assert matcher.stop_string is None


def test_unsearched_text_cannot_end_a_stop_string_but_may_start_one():
    matcher = StopStrings(["ab"])
    assert matcher.add("xab", search=False) == "xab"  # min_tokens: not searched
    assert matcher.add("a", search=False) == ""  # held: it may start "ab"
    assert matcher.add("b") == "" and matcher.stop_string == "ab"


def test_a_stop_string_completing_first_wins_over_one_starting_first():
    shown, stop = stream(["abcd", "c"], ["abcd"])
    assert (shown, stop) == (["ab"], "c")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_streamed_text_is_the_reference_however_it_is_split(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    matcher = StopStrings(stops, include)
    shown, fed = "", ""
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        shown += matcher.add(piece, final=final)
        fed += piece
        if matcher.stop_string is None and not final and not include:
            # Held back: exactly the longest end of the text that could still start a stop string.
            held = max((k for k in range(1, len(fed) + 1)
                        if any(s.startswith(fed[-k:]) and len(s) > k for s in stops)), default=0)
            assert shown == fed[:len(fed) - held]
    expected, stop = reference(text, stops, include)
    assert (shown, matcher.stop_string) == (expected, stop)
