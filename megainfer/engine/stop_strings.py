"""Stop strings over a request's streamed text (vLLM's semantics, without its fixed hold-back).

The text ends before the first stop string to complete (or just after it, with
`include_stop_str_in_output`). While streaming, text that could still be the start of a stop
string is held back until it cannot, so a client never sees part of a stop string that is
later cut; at the end whatever is held is released. Each call searches only the new text and
the `len(stop) - 1` characters before it, and keeps no more than that of the past: the cost per
call does not grow with the output.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool = False) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.include_in_output = include_in_output
        self._longest = max(map(len, self.stops))
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._context = ""  # the last characters already returned (at most longest - 1)
        self._held = ""  # text searched but not yet returned: a suffix that may start a stop string
        self.stop_string: str | None = None  # the stop string found, once found

    def add(self, text: str, search: bool = True, final: bool = False) -> str:
        """Append `text`; return what may be shown now. `search` False: the text may not end a
        stop string (vLLM's min_tokens: text of the first min_tokens tokens is never searched),
        though a stop string may start in it. `final`: the request ends, nothing is held back.
        After a stop string was found (`stop_string`), returns "" for anything more."""
        if self.stop_string is not None:
            return ""
        window = self._context + self._held + text
        searched = len(window) - len(text)
        if search and text:
            found = self._find(window, searched)
            if found is not None:
                stop, index = found
                self.stop_string = stop
                end = index + len(stop) if self.include_in_output else index
                out = window[len(self._context):max(end, len(self._context))]
                self._context, self._held = "", ""
                return out
        pending = window[len(self._context):]
        keep = 0 if final or self.include_in_output else self._may_start_stop(pending)
        out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self._context = (self._context + out)[-(self._longest - 1):] if self._longest > 1 else ""
        return out

    def _find(self, window: str, searched: int) -> tuple[str, int] | None:
        """The stop string in `window` that ends first past `searched` (of two ending together,
        the longer): (it, where it starts). By the end, not the start: the text stops where a
        stop string first completes, however the text was split into calls."""
        best, best_key = None, None
        for stop in self.stops:
            index = window.find(stop, max(0, searched - len(stop) + 1))
            if index != -1 and (best_key is None or (index + len(stop), index) < best_key):
                best, best_key = (stop, index), (index + len(stop), index)
        return best

    def _may_start_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[start] in self._first_chars:
                suffix = text[start:]
                if any(stop.startswith(suffix) and len(stop) > len(suffix) for stop in self.stops):
                    return len(text) - start
        return 0
