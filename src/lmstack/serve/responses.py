"""Pieces of the OpenAI response objects shared by streamed and non-streamed answers: the logprobs
objects (chat's ``content`` list, the legacy completions' parallel lists with ``text_offset``), the
finish reason and the usage block."""

from __future__ import annotations

from lmstack.serve.server import Server


def chat_logprobs(server: Server, entries) -> dict:
    """OpenAI chat logprobs over (token, (logprob, top)) entries: text, bytes and the top alternatives."""
    content = []
    for token, (lp, top) in entries:
        text, raw = server.token_text(token)
        tops = []
        for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
            tt, tr = server.token_text(t)
            tops.append({"token": tt, "logprob": v, "bytes": tr})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(server: Server, entries, offset: int) -> dict:
    """OpenAI's legacy logprobs object over (token, (logprob, top) or None) entries; None (the first
    prompt token under ``echo``: nothing precedes it) gives null logprob and top_logprobs."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, entry in entries:
        text, _ = server.token_text(token)
        tokens.append(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
        else:
            lp, top = entry
            lps.append(lp)
            d: dict[str, float] = {}
            for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
                d.setdefault(
                    server.token_text(t)[0], v
                )  # two tokens with one text (partial UTF-8): the likelier
            tops.append(d)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def finish_reason(out, tool_output=None) -> str | None:
    """The engine's reasons ("stop", "length") are OpenAI's; None while running; "tool_calls" when a
    finished ("stop") output is a tool call (``tool_output``: the choice's ``tools.ToolOutput``)."""
    if not out.finished:
        return None
    if out.finish_reason == "stop" and tool_output is not None and tool_output.called(out.text):
        return "tool_calls"
    return out.finish_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def ids_json(ids: list[int], piece: int = 1 << 15) -> str:
    """``ids`` as a JSON array, written a slice at a time: each slice is one short C call, so a worker thread
    writing a multi-MB answer gives the event loop's thread the GIL between slices (one ``json.dumps`` of the
    whole list holds it for the whole list)."""
    return (
        "["
        + ",".join(",".join(map(str, ids[i : i + piece])) for i in range(0, len(ids), piece))
        + "]"
    )
