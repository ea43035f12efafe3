"""lm-evaluation-harness with model ``lmstack``, offline, on locally defined tasks: its numbers equal
lmstack's own runner on the same items, and its rolling log-likelihood equals HF transformers'."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_DATASETS_OFFLINE"] = "1"  # lm-eval reaches for the hub otherwise: nothing here may
os.environ["HF_HUB_OFFLINE"] = "1"
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness: pip install 'lmstack[test]'"
)

from lmstack.eval.harness import LMStackLM  # noqa: E402
from lmstack.eval.runner import Evaluator, run_task  # noqa: E402
from lmstack.eval.tasks import load_task  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = [
    {"question": q, "choices": c, "answer": a}
    for q, c, a in [
        ("the cat is", ["at the hat", "this", "the theatre"], 0),
        ("where is the hat?", ["at the cat", "the", "heart"], 2),
        ("this is", ["a cat", "a hat", "the cat sat"], 1),
        ("A: the", ["cat", "hat", "theatre", "is"], 3),
        ("is this the cat?", ["yes", "no"], 0),
        ("the heart", ["is at", "sat", "hat"], 1),
        ("hat or cat", ["hat", "cat"], 1),
        ("the theatre is", ["there", "here", "at the cat"], 2),
        # non-ASCII: lm-eval divides by characters; "日本" is 2 characters, 6 bytes (per byte it would win here)
        ("the cat is", ["日本", "x"], 1),
        ("where is", ["the hat", "über café"], 0),
    ]
]

LM_EVAL_MC = """task: lmstack_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

LM_EVAL_ROLLING = """task: lmstack_local_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""

LM_EVAL_GEN = """task: lmstack_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["t"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _evaluate(lm, tmp_path, spec, name):
    (tmp_path / "tasks").mkdir(exist_ok=True)
    (tmp_path / "tasks" / f"{name}.yaml").write_text(spec)
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tmp_path / "tasks"))
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[name],
        task_manager=tm,
        num_fewshot=0,
        bootstrap_iters=0,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return out


@pytest.fixture(scope="module")
def harness_lm(lm):
    model, tok = lm
    return LMStackLM(model=model, tokenizer=tok)


def test_registered():
    from lm_eval.api.registry import get_model

    assert get_model("lmstack") is LMStackLM
    assert get_model("hf").__name__ == "HFLM"  # the built-in names are still there


def test_multiple_choice_equals_builtin_runner(lm, harness_lm, tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    res = _evaluate(harness_lm, tmp_path, LM_EVAL_MC.format(data=data), "lmstack_local_mc")
    got = res["results"]["lmstack_local_mc"]
    spec = tmp_path / "mine.yaml"
    spec.write_text(f'data: {data.name}\nprompt: "Q: {{question}}\\nA:"\n')
    mine = run_task(load_task(spec), Evaluator(*lm), progress=False)
    assert got["acc,none"] == pytest.approx(mine.metrics["acc"])
    assert got["acc_norm,none"] == pytest.approx(mine.metrics["acc_norm"])
    # per option: lm-eval's recorded log-likelihoods are ours
    for s, m in zip(
        sorted(res["samples"]["lmstack_local_mc"], key=lambda s: s["doc_id"]), mine.samples
    ):
        assert [float(r[0][0]) for r in s["resps"]] == pytest.approx(m["loglik"], rel=1e-9)


def test_rolling_equals_hf(lm, hf_model, harness_lm, tmp_path):
    _, tok = lm
    texts = ["the cat is at the hat.", "this theatre is where the cat sat, at the heart of it all"]
    data = tmp_path / "roll.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = _evaluate(
        harness_lm, tmp_path, LM_EVAL_ROLLING.format(data=data), "lmstack_local_rolling"
    )
    nll, nbytes = 0.0, 0
    bos = lm[0].config.bos_token_id
    for (
        t
    ) in texts:  # each fits the context 64: one forward from the prefix token scores every token
        ids = tok.encode(t)
        assert len(ids) < 64
        with torch.no_grad():
            logp = F.log_softmax(hf_model(torch.tensor([[bos] + ids])).logits[0, :-1].double(), -1)
        nll -= float(logp.gather(-1, torch.tensor(ids)[:, None]).sum())
        nbytes += len(t.encode())
    assert res["results"]["lmstack_local_rolling"]["bits_per_byte,none"] == pytest.approx(
        nll / nbytes / math.log(2), rel=1e-6
    )


def test_generate_until_equals_builtin_runner(lm, harness_lm, tmp_path):
    rows = [{"context": "the cat", "answer": "x"}, {"context": "this is", "answer": "y"}]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _evaluate(harness_lm, tmp_path, LM_EVAL_GEN.format(data=data), "lmstack_local_gen")
    outs = [
        s["resps"][0][0]
        for s in sorted(res["samples"]["lmstack_local_gen"], key=lambda s: s["doc_id"])
    ]
    spec = tmp_path / "g.yaml"
    spec.write_text(f"data: {data.name}\nkind: generate\nstop: ['t']\nmax_tokens: 5\n")
    mine = run_task(load_task(spec), Evaluator(*lm), progress=False)
    assert outs == [s["output"] for s in mine.samples]


def test_lmstack_eval_harness_cli(tiny_dir, lm, tmp_path):
    """`lmstack eval harness ...` runs lm-eval's own command line with model `lmstack` and a local task."""
    from lmstack.cli import main

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "lmstack_local_mc.yaml").write_text(LM_EVAL_MC.format(data=data))
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "harness",
                "run",
                "--model",
                "lmstack",
                "--model_args",
                f"model={tiny_dir}",
                "--tasks",
                "lmstack_local_mc",
                "--include_path",
                str(tmp_path / "tasks"),
                "--output_path",
                str(out),
            ]
        )
        == 0
    )
    (result,) = out.rglob("results_*.json")
    got = json.loads(result.read_text())["results"]["lmstack_local_mc"]
    spec = tmp_path / "mine.yaml"
    spec.write_text(f'data: {data.name}\nprompt: "Q: {{question}}\\nA:"\n')
    assert got["acc,none"] == pytest.approx(
        run_task(load_task(spec), Evaluator(*lm), progress=False).metrics["acc"]
    )


def test_unknown_model_args_are_refused_by_name(tiny_dir):
    """Issue #31: `--model_args ... dtyp=int4` ran fp32 silently (unknown keys were swallowed)."""
    from lm_eval.api.registry import get_model

    cls = get_model("lmstack")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['dtyp'\]"):
        cls.create_from_arg_string(
            f"model={tiny_dir},dtyp=int4", {"batch_size": 1, "device": "cpu"}
        )
    ok = cls.create_from_arg_string(
        f"model={tiny_dir},dtype=fp32", {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    )
    assert ok.max_gen_toks == 256
