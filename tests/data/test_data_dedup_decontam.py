"""Decontamination on planted 13-grams: a training document sharing 13 consecutive words (after
normalisation) with an evaluation item is dropped; 12 shared words, or 13 not in a row, are not."""

import json

import pytest

from lmstack.data.dedup.decontam import Decontaminate, EvalNgrams, builtin_texts
from lmstack.data.document import Document
from lmstack.data.step import StepStats

ITEM = "The quick brown fox jumps over the lazy dog while seven wizards quietly box the jolly frog"


def test_planted_13_gram_from_a_task_file(tmp_path):
    task = tmp_path / "task.jsonl"
    task.write_text(
        json.dumps({"context": f"Question: {ITEM}?", "answer": "yes"})
        + "\n"
        + json.dumps({"context": "too short to matter", "answer": "no"})
        + "\n",
        encoding="utf-8",
    )
    words = ITEM.split()
    planted = " ".join(words[2:15])  # 13 consecutive words of the item
    docs = [
        Document(f"Some crawl text. {planted.upper()}, and then more text.", "planted"),
        Document(f"Some crawl text. {' '.join(words[2:14])} and then more.", "twelve"),
        Document(" ".join(words[2:9] + ["interrupted"] + words[9:15]), "not_in_a_row"),
        Document(
            "Brown fox, jumps over... the LAZY dog while séven wizards quietly box the jölly",
            "normalised",
        ),
        Document("jolly frog? yes", "answer_tail_too_short"),
        Document("box the jolly frog yes and more", "spans_prompt_and_answer_short"),
    ]
    stats = StepStats("decontaminate")
    kept = [d.id for d in Decontaminate(tasks=[task], builtin=False)(docs, stats)]
    assert kept == [
        "twelve",
        "not_in_a_row",
        "answer_tail_too_short",
        "spans_prompt_and_answer_short",
    ]
    assert dict(stats.dropped) == {"eval_contamination": 2}


def test_prompt_and_answer_together_form_13_grams(tmp_path):
    """An item's text is its rendered prompt + delimiter + gold answer: a 13-gram across the boundary counts."""
    task = tmp_path / "t.yaml"
    (tmp_path / "items.jsonl").write_text(
        json.dumps(
            {
                "q": "one two three four five six seven eight nine ten",
                "choices": ["eleven twelve thirteen", "zero"],
                "answer": 0,
            }
        )
        + "\n",
        encoding="utf-8",
    )
    task.write_text("name: t\ndata: items.jsonl\nprompt: 'Q: {q}'\n", encoding="utf-8")
    ng = EvalNgrams.from_eval([task], builtin=False)
    assert (
        ng.overlaps("x one two three four five six seven eight nine ten eleven twelve thirteen y")
        == 1
    )
    assert (
        ng.overlaps("q one two three four five six seven eight nine ten eleven twelve") == 1
    )  # "Q:" is prompt
    assert ng.overlaps("one two three four five six seven eight nine ten eleven twelve zero") == 0


@pytest.mark.slow
def test_builtin_eval_sets():
    """The built-in sets (lmstack eval make-data's docstring items and held-out stdlib text) are read; a
    planted sentence from one of their texts is caught."""
    texts = list(builtin_texts())
    long = next(t for t in texts if len(t.split()) >= 13)
    ng = EvalNgrams(texts)
    assert ng.texts == len(texts) and len(ng.hashes) > 1000
    f = Decontaminate(ng)
    assert (
        f.reason(Document("Intro. " + " ".join(long.split()[:13]) + " outro.", "x"))
        == "eval_contamination"
    )
    assert (
        f.reason(
            Document("an ordinary web page about gardening and tomatoes in the summer months", "y")
        )
        is None
    )


def test_bad_n():
    with pytest.raises(ValueError, match="n=0"):
        EvalNgrams([], n=0)
