"""Routing technical documents past the prose rules: line kinds counted by hand, the router's thresholds at
their boundaries, a filter limited by ``routes`` (in Python and in a pipeline table), the code rules at each
threshold, and datatrove's Gopher filter as the reference for what the prose rules do to documentation."""

import pytest

from lmstack.data.document import Document
from lmstack.data.pipeline import Pipeline, build_step
from lmstack.data.quality import GopherQuality
from lmstack.data.route import CodeQuality, CodeRouter, line_kinds
from lmstack.data.step import StepStats

PROSE = "The function returns the number of bytes that were written to the stream."  # 14 words, "."
DOC = "\n".join(
    [
        "Writing to a stream",  # neither: 4 words
        PROSE,
        "    n = stream.write(buf, len)",  # indented
        "Call it again when the return value is smaller than the length you asked for.",
        "if (n < 0) { perror(); }",  # symbols and a call
        "    return n;",
        "The call blocks until the kernel has taken every byte of the buffer from you.",
        "$ strace -e write ./demo",  # a prompt and an option
        "See write_all for a loop that does it.",  # snake_case: code-like, though prose-shaped
        "  close(fd);",
    ]
)


def test_line_kinds_by_hand():
    # code: the 4 indented/symbol lines, the prompt, the snake_case line; prose: the 3 sentences
    assert line_kinds(DOC) == (10, 6, 3)
    assert line_kinds("") == (0, 0, 0) and line_kinds("\n  \n") == (0, 0, 0)
    assert line_kinds("a b c d e f g h.") == (1, 0, 1)  # 8 words and a full stop
    assert line_kinds("a b c d e f g.") == (1, 0, 0)  # 7 words: neither
    assert line_kinds("use getValue here") == (1, 1, 0)  # camelCase
    assert line_kinds("x" * 9 + "{") == (1, 1, 0)  # 1 symbol in 10 characters: >= 0.1


def test_router_thresholds_at_their_boundaries():
    r = CodeRouter(min_code_lines=6, min_code_frac=0.6, min_prose_lines=3)
    assert r.route(DOC) == ("code", 0.6)
    assert CodeRouter(min_code_lines=7).route(DOC)[0] == "prose"  # 6 code lines < 7
    assert CodeRouter(min_code_frac=0.6 + 1e-9).route(DOC)[0] == "prose"
    assert CodeRouter(min_prose_lines=4).route(DOC)[0] == "prose"
    script = "\n".join(f"function f{i}(x) {{ return x * {i}; }}" for i in range(30))
    assert (
        CodeRouter().route(script)[0] == "prose"
    )  # code with no explanation: the prose rules judge it
    assert CodeRouter().route("\n".join([PROSE] * 20))[0] == "prose"
    with pytest.raises(ValueError, match="min_code_frac"):
        CodeRouter(min_code_frac=1.5)
    st = StepStats("code_router")
    out = list(CodeRouter()([Document(DOC, "a"), Document(PROSE, "b")], st))
    assert [d.metadata["route"] for d in out] == ["code", "prose"]
    assert out[0].metadata["code_line_frac"] == 0.6
    assert st.counters == {"route_code": 1, "route_prose": 1}


def test_a_routed_filter_passes_other_routes_untouched():
    short = GopherQuality()
    short.routes = ("prose",)
    docs = [
        Document("too short", "p", {"route": "prose"}),
        Document("too short", "c", {"route": "code"}),
        Document("too short", "n"),  # no route: judged
    ]
    st = StepStats("gopher_quality")
    kept = [d.id for d in short(docs, st)]
    assert kept == ["c"] and st.dropped == {"gopher_short_doc": 2}
    assert st.counters == {"passed_route_code": 1} and (st.docs_in, st.docs_out) == (3, 1)
    # in a pipeline table
    step = build_step({"type": "gopher_quality", "routes": ["prose"]})
    assert step.routes == ("prose",) and GopherQuality.routes is None
    with pytest.raises(ValueError, match="routes="):
        build_step({"type": "gopher_quality", "routes": "prose"})
    with pytest.raises(ValueError, match="on a filter"):
        build_step({"type": "pii", "routes": ["prose"]})


def test_code_quality_thresholds():
    q = CodeQuality(min_words=5, max_words=8, max_line_chars=20, min_alnum_frac=0.25)
    assert q.reason(Document("a b c d", "x")) == "code_short_doc"  # 4 words < 5
    assert q.reason(Document("a b c d e", "x")) is None
    assert q.reason(Document("a b c d e f g h i", "x")) == "code_long_doc"  # 9 words > 8
    assert q.reason(Document("aaaa bbbb cccc ddd e", "x")) is None  # a 20-character line
    assert q.reason(Document("aaaa bbbb cccc dddd e", "x")) == "code_long_line"  # 21
    q = CodeQuality(min_words=5, min_alnum_frac=0.25)
    assert q.reason(Document("a(( b)) c{{ d}} e;;;", "x")) is None  # 5 alphanumeric of 20: 0.25
    assert q.reason(Document("a(( b)) c{{ d}} e;;;;", "x")) == "code_below_alnum_threshold"  # of 21


def test_gopher_drops_documentation_the_router_sends_past_it(tmp_path):
    """datatrove's Gopher filter (the reference) drops the documentation page for its word shapes; the
    routed pipeline keeps it through the code rules, and still drops short prose."""
    pytest.importorskip("datatrove")
    from datatrove.data import Document as DTDocument
    from datatrove.pipeline.filters import GopherQualityFilter

    page = "\n".join([DOC] * 6)  # 60 lines, 6 * 64 whitespace words
    assert GopherQualityFilter().filter(DTDocument(text=page, id="d")) is not True
    assert GopherQuality().reason(Document(page, "d")) is not None
    import json

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        json.dumps({"id": "doc", "text": page})
        + "\n"
        + json.dumps({"id": "p", "text": PROSE})
        + "\n"
    )
    p = Pipeline.from_dict(
        {
            "output": str(tmp_path / "out"),
            "step": [
                {"type": "read_jsonl", "paths": [str(tmp_path / "in")]},
                {"type": "code_router"},
                {"type": "gopher_quality", "routes": ["prose"]},
                {"type": "code_quality", "routes": ["code"]},
                {
                    "type": "write_jsonl",
                    "output": str(tmp_path / "out" / "docs"),
                    "compression": None,
                },
            ],
        }
    )
    from lmstack.data.executor import LocalExecutor

    LocalExecutor(1, progress=False).run(p)
    kept = [json.loads(ln)["id"] for ln in next((tmp_path / "out" / "docs").glob("*.jsonl")).open()]
    assert kept == ["doc"]
