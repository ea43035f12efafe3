"""The task runner against hand computations from HF transformers' logits; bad task files."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmstack.eval.runner import Evaluator, extract, mean_stderr, run_task, table
from lmstack.eval.scoring import encode_pair
from lmstack.eval.tasks import TaskError, load_task

MC = [
    {
        "question": "the cat is",
        "choices": ["at the hat", "this", "the theatre is here"],
        "answer": 0,
    },
    {"question": "where is the hat?", "choices": ["at the cat", "the", "heart"], "answer": 2},
    {"question": "this is", "choices": ["a cat", "a hat", "the cat sat"], "answer": 1},
    {"question": "A: the", "choices": ["cat", "hat", "theatre", "is"], "answer": 3},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@torch.no_grad()
def hf_sum_logprob(hf_model, ctx, cont):
    ids = torch.tensor([ctx + cont])
    logp = F.log_softmax(hf_model(ids).logits[0].double(), -1)
    return sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))


def test_encode_pair_moves_trailing_space(lm):
    _, tok = lm
    ctx, cont = encode_pair(tok, "the cat ", "at")
    assert ctx == tok.encode("the cat")
    # " at" is one piece; BPE merges " "+"a" (the 4th merge) before "a"+"t" (the 7th): [" a", "t"]
    assert cont == [tok.token_to_id(b" a"), tok.token_to_id(b"t")]


def test_multiple_choice_equals_hand_loglik(lm, hf_model, tmp_path):
    model, tok = lm
    data = write_jsonl(tmp_path / "mc.jsonl", MC)
    spec = tmp_path / "mc.yaml"
    spec.write_text('name: mc\ndata: mc.jsonl\nprompt: "Q: {question}\\nA:"\n')
    res = run_task(load_task(spec), Evaluator(model, tok), progress=False)
    acc, acc_norm = [], []
    for row, s in zip(MC, res.samples):
        ctx_text = f"Q: {row['question']}\nA:"
        lls = [
            hf_sum_logprob(hf_model, *encode_pair(tok, ctx_text, " " + c)) for c in row["choices"]
        ]
        assert s["loglik"] == pytest.approx(lls, rel=1e-6, abs=1e-6)
        acc.append(float(np.argmax(lls) == row["answer"]))
        acc_norm.append(
            float(np.argmax([ll / len(c) for ll, c in zip(lls, row["choices"])]) == row["answer"])
        )
    assert res.metrics["acc"] == pytest.approx(np.mean(acc))
    assert res.metrics["acc_norm"] == pytest.approx(np.mean(acc_norm))
    p = np.mean(acc)
    assert res.stderr["acc"] == pytest.approx(
        np.sqrt(p * (1 - p) / (len(MC) - 1))
    )  # binomial, n - 1
    assert "acc_norm" in table([res]) and data.exists()


def test_loglikelihood_task_and_empty_context(lm, hf_model, tmp_path):
    model, tok = lm
    rows = [
        {"context": "the cat", "continuation": "is at the hat"},
        {"context": "", "continuation": "this"},
    ]
    res = run_task(
        load_task(write_jsonl(tmp_path / "ll.jsonl", rows)), Evaluator(model, tok), progress=False
    )
    assert res.kind == "loglikelihood"
    bos = model.config.bos_token_id
    ref0 = hf_sum_logprob(hf_model, *encode_pair(tok, "the cat", " is at the hat"))
    ref1 = hf_sum_logprob(
        hf_model, [bos], tok.encode(" this")
    )  # empty context: BOS first, as lm-eval
    assert [s["loglik"] for s in res.samples] == pytest.approx([ref0, ref1], rel=1e-6)


def test_context_longer_than_window_keeps_last_tokens(lm, hf_model):
    model, tok = lm
    ev = Evaluator(model, tok, max_length=16)
    ctx = tok.encode("the cat is at the hat and this is where the theatre is")
    cont = tok.encode(" the cat")
    assert len(ctx) + len(cont) > 17
    ((ll, _),) = ev.loglikelihood_tokens([(ctx, cont)])
    row = (ctx + cont)[-17:]
    assert ll == pytest.approx(hf_sum_logprob(hf_model, row[: -len(cont)], cont), rel=1e-6)


def test_generate_exact_match_equals_hf_greedy(lm, hf_model, tmp_path):
    model, tok = lm
    rows = [
        {"context": "the cat", "answer": "x"},
        {"context": "this is", "answer": "y"},
        {"context": "Q: hat?", "answer": "z"},
    ]
    write_jsonl(tmp_path / "gen.jsonl", rows)
    spec = tmp_path / "gen.yaml"
    spec.write_text("data: gen.jsonl\nkind: generate\nmax_tokens: 6\nstop: ['t']\nfewshot: 1\n")
    task = load_task(spec)
    res = run_task(task, Evaluator(model, tok), progress=False)
    for prompt, s in zip(task.prompts(), res.samples):
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        text = tok.decode(out)
        ref = text[: text.find("t")] if "t" in text else text
        assert s["output"] == ref
    # gold answers absent from a random model's output: exact match 0, and the few-shot prompts are fixed
    assert res.metrics["exact_match"] == 0.0
    assert task.prompts() == load_task(spec).prompts()
    assert task.prompts()[0].endswith("the cat") and task.prompts()[0].count("\n\n") == 1


def test_fewshot_excludes_the_item_and_is_seeded(tmp_path):
    rows = [{"context": f"q{i}", "continuation": f"a{i}"} for i in range(10)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "t.yaml").write_text("data: d.jsonl\nfewshot: 3\nfewshot_seed: 7\n")
    (tmp_path / "u.yaml").write_text("data: d.jsonl\nfewshot: 3\nfewshot_seed: 8\n")
    p = load_task(tmp_path / "t.yaml").prompts()
    for i, s in enumerate(p):
        shots = s.split("\n\n")[:-1]
        assert len(shots) == 3 and f"q{i} " not in s and s.endswith(f"q{i}")
    assert p != load_task(tmp_path / "u.yaml").prompts()


def test_extract():
    assert extract("so the answer is 42.", r"answer is (\d+)") == "42"
    assert extract("no number", r"answer is (\d+)") == "[invalid]"
    assert extract("  7 ", None) == "7"
    assert mean_stderr([1.0]) is None


@pytest.mark.parametrize(
    "rows,spec,match",
    [
        ([{"question": "q", "choices": ["a", "b"]}], None, r"mc\.jsonl:1: missing field 'answer'"),
        (
            [
                {"question": "q", "choices": ["a", "b"], "answer": 0},
                {"question": "q", "choices": ["a", "b"], "answer": 2},
            ],
            None,
            r"mc\.jsonl:2: field 'answer' = 2 is out of range: there are 2 choices",
        ),
        ([{"choices": ["a", "b"], "answer": 0}], None, r"mc\.jsonl:1: missing field 'question'"),
        ([{"question": "q", "choices": ["a"], "answer": 0}], None, r"mc\.jsonl:1: field 'choices'"),
        (
            [{"question": "q", "choices": ["a", "b"], "answer": "0"}],
            None,
            r"mc\.jsonl:1: field 'answer' = '0'",
        ),
        ([], None, r"mc\.jsonl: no items \(empty dataset\)"),
        (
            [{"question": "q", "choices": ["a", "b"], "answer": 0}],
            "kind: essay\n",
            r"field 'kind' = 'essay'",
        ),
        (
            [{"question": "q", "choices": ["a", "b"], "answer": 0}],
            "fewshots: 2\n",
            r"unknown field\(s\) \['fewshots'\]",
        ),
    ],
)
def test_bad_task_files(tmp_path, rows, spec, match):
    write_jsonl(tmp_path / "mc.jsonl", rows)
    y = tmp_path / "mc.yaml"
    y.write_text("data: mc.jsonl\nprompt: '{question}'\n" + (spec or ""))
    with pytest.raises(TaskError, match=match):
        load_task(y)


def test_bad_json_line_and_missing_data(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"context": "a", "continuation": "b"}\n\n{oops\n')
    with pytest.raises(TaskError, match=r"x\.jsonl:3: not valid JSON"):
        load_task(tmp_path / "x.jsonl")
    (tmp_path / "y.yaml").write_text("name: y\n")
    with pytest.raises(TaskError, match=r"y\.yaml: missing field 'data'"):
        load_task(tmp_path / "y.yaml")
    (tmp_path / "z.jsonl").write_text('{"context": "a"}\n')
    with pytest.raises(TaskError, match=r"z\.jsonl:1: missing field 'answer'"):
        load_task(tmp_path / "z.jsonl")


def test_shared_context_runs_once_and_equals_hf(lm, hf_model):
    """Options of one item share their context: ``shared_context_scores`` prefills it once into a KV cache and
    scores each continuation from a copy; every option's log-likelihood equals HF's full forward on the row."""
    from lmstack.eval.scoring import can_share_context, shared_context_scores

    model, tok = lm
    ctx = tok.encode("Q: which module reads JSON?\nA:")
    conts = [tok.encode(" json"), tok.encode(" the csv module"), tok.encode(" x")]
    assert can_share_context(model)
    ctx2 = tok.encode("Q: and which one writes CSV files, line by line?\nA:")
    rows = [ctx + c for c in conts] + [ctx2 + c for c in conts]
    starts = [len(ctx)] * 3 + [len(ctx2)] * 3
    got = shared_context_scores(model, rows, starts, [[0, 1, 2], [3, 4, 5]])  # two items, one batch
    scores = [got[i] for i in range(6)]
    for s, c, x in zip(scores, conts + conts, [ctx] * 3 + [ctx2] * 3):
        c = list(c)
        assert float(s.logprobs.sum()) == pytest.approx(
            hf_sum_logprob(hf_model, x, c), rel=1e-6, abs=1e-5
        )
    for s, c in zip(scores, conts):
        assert len(s.logprobs) == len(c)
        assert float(s.logprobs.sum()) == pytest.approx(
            hf_sum_logprob(hf_model, ctx, c), rel=1e-6, abs=1e-5
        )


NON_ASCII = [
    {"question": "the cat is", "choices": ["日本", "x"], "answer": 1},
    {"question": "where is", "choices": ["the hat", "über café"], "answer": 0},
]


def test_acc_norm_divides_by_characters_not_bytes(lm, hf_model, tmp_path):
    """lm-eval's acc_norm divides by ``len(choice)`` in characters: "日本" is 2 characters (6 UTF-8 bytes),
    so per character it is far less likely than "x" (-19.2 vs -11.2 nats per character) — per byte it would
    win (-6.4). Log-likelihoods from HF's logits."""
    model, tok = lm
    write_jsonl(tmp_path / "na.jsonl", NON_ASCII)
    spec = tmp_path / "na.yaml"
    spec.write_text('name: na\ndata: na.jsonl\nprompt: "Q: {question}\\nA:"\n')
    res = run_task(load_task(spec), Evaluator(model, tok), progress=False)
    row = NON_ASCII[0]
    lls = [
        hf_sum_logprob(hf_model, *encode_pair(tok, f"Q: {row['question']}\nA:", " " + c))
        for c in row["choices"]
    ]
    by_char = int(np.argmax([ll / len(c) for ll, c in zip(lls, row["choices"])]))
    by_byte = int(np.argmax([ll / len(c.encode()) for ll, c in zip(lls, row["choices"])]))
    assert (by_char, by_byte) == (1, 0)  # the item tells the two apart
    assert res.samples[0]["pred_norm"] == by_char
    assert res.samples[0]["loglik"] == pytest.approx(lls, rel=1e-6)
