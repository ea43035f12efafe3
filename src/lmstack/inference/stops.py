"""Stopping: the token rules and stop strings — the one place that decodes, cuts and holds text back.

Book of LLMs §2.6 (stopping rules), CS336 notes "推理流程". A stop string can span several tokens and a
token can end in the middle of a UTF-8 character, so while a request runs the text shown is held
back by an incomplete character and by the last ``max(len(stop)) - 1`` characters (they may be
the start of a stop string). Used by the engine and by ``stream_generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmstack.inference.sampling import SamplingParams


def find_stop_string(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or -1."""
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def token_stop(
    token: int, num_output: int, params: SamplingParams, eos_token_id: int | None = None
) -> str | None:
    """The token rules every decode loop applies after emitting ``token`` (the ``num_output``-th):
    "stop" for EOS (unless ``ignore_eos``) or a stop token id, "length" at ``max_tokens``, else None."""
    if (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    return "length" if num_output >= params.max_tokens else None


class StopStrings:
    """The decoded text of one request's output, cut before the first stop string."""

    __slots__ = ("tokenizer", "stop", "hold", "text", "sent")

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold = (
            max((len(s) for s in self.stop), default=1) - 1
        )  # chars that may start a stop string
        self.text = ""
        self.sent = 0  # characters handed out by ``delta``

    def update(self, output_ids: Sequence[int]) -> bool:
        """Decode the output so far; True when a stop string appeared (``text`` then ends before it)."""
        old = len(self.text)
        self.text = self.tokenizer.decode(output_ids)
        if self.stop:
            at = find_stop_string(self.text, self.stop, max(0, old - self.hold - 1))
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def emit(self, finished: bool) -> tuple[str, str]:
        """(text that may be shown now, its part not returned by earlier calls). Once finished all of
        it; while running, without an incomplete UTF-8 character and what may start a stop string."""
        text = self.text
        if not finished:
            while text.endswith("\ufffd"):
                text = text[:-1]
            if self.stop:
                text = text[: max(0, len(text) - self.hold)]
        new = text[self.sent :] if len(text) >= self.sent else ""
        self.sent = max(self.sent, len(text))
        return text, new
