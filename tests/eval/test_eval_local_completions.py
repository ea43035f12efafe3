"""lm-eval's ``local-completions`` client against a live ``lmstack serve`` (the OpenAI-compatible
server): its log-likelihood requests (``echo`` + ``logprobs``, token-id prompts) give the same
per-option log-likelihoods (1e-4) and the same multiple-choice accuracy as lmstack's own runner on the
same items, and the same rolling log-likelihood (bits per byte) as HF transformers."""

import contextlib
import json
import math
import os
import socket
import threading
import time

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness: pip install 'lmstack[test]'"
)
pytest.importorskip("aiohttp", reason="lm-eval's API models need aiohttp (lm-eval[api])")

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
    ]
]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MC = """output_type: multiple_choice
doc_to_text: "Q: {{question}}\\nA:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
"""


@contextlib.contextmanager
def serving(model, tok, name):
    """``lmstack serve``'s app over the model, under uvicorn in a thread on a free port."""
    import uvicorn

    from lmstack.inference.engine import LLMEngine
    from lmstack.serve.app import Server, build_app

    engine = LLMEngine(model, tok, block_size=4, num_blocks=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(
            build_app(Server(engine, name)),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t0 < 30, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        srv.should_exit = True
        th.join(10)


@pytest.fixture(scope="module")
def client_lm(lm, tiny_dir):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok = lm
    with serving(model, tok, "tiny") as url:
        yield LocalCompletionsAPI(
            base_url=url,
            model="tiny",
            tokenizer=str(tiny_dir),
            tokenizer_backend="huggingface",
            max_length=model.config.max_seq_len,
            batch_size=4,
            # the folder's tokenizer.json names no BOS for AutoTokenizer: the model's own
            custom_prefix_token_id=model.config.bos_token_id,
        )


def _evaluate(lm_obj, tmp_path, spec, name):
    from lm_eval.tasks import TaskManager

    (tmp_path / "tasks").mkdir(exist_ok=True)
    (tmp_path / "tasks" / f"{name}.yaml").write_text(spec)
    return lm_eval.simple_evaluate(
        model=lm_obj,
        tasks=[name],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        num_fewshot=0,
        bootstrap_iters=0,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_hf_tokenizer_matches(lm, client_lm):
    """lm-eval tokenises on its side (AutoTokenizer of the same folder): the same ids as lmstack's."""
    text = "Q: the theatre is\nA: at the cat"
    assert client_lm.tok_encode(text) == lm[1].encode(text)


def test_multiple_choice_equals_runner(lm, client_lm, tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    res = _evaluate(
        client_lm, tmp_path, TASK.format(name="lmstack_lc_mc", data=data) + MC, "lmstack_lc_mc"
    )
    got = res["results"]["lmstack_lc_mc"]
    spec = tmp_path / "mine.yaml"
    spec.write_text(f'data: {data.name}\nprompt: "Q: {{question}}\\nA:"\n')
    mine = run_task(load_task(spec), Evaluator(*lm), progress=False)
    assert got["acc,none"] == pytest.approx(mine.metrics["acc"])
    assert got["acc_norm,none"] == pytest.approx(mine.metrics["acc_norm"])
    for s, m in zip(
        sorted(res["samples"]["lmstack_lc_mc"], key=lambda s: s["doc_id"]),
        mine.samples,
        strict=True,
    ):
        assert [float(r[0][0]) for r in s["resps"]] == pytest.approx(m["loglik"], abs=1e-4)


def test_rolling_equals_hf(lm, hf_model, client_lm, tmp_path):
    _, tok = lm
    texts = ["the cat is at the hat.", "this theatre is where the cat sat, at the heart of it all"]
    data = tmp_path / "roll.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = _evaluate(
        client_lm,
        tmp_path,
        TASK.format(name="lmstack_lc_roll", data=data) + ROLLING,
        "lmstack_lc_roll",
    )
    nll, nbytes = 0.0, 0
    bos = lm[0].config.bos_token_id
    for t in texts:
        ids = tok.encode(t)
        with torch.no_grad():
            logp = F.log_softmax(hf_model(torch.tensor([[bos] + ids])).logits[0, :-1].double(), -1)
        nll -= float(logp.gather(-1, torch.tensor(ids)[:, None]).sum())
        nbytes += len(t.encode())
    assert res["results"]["lmstack_lc_roll"]["bits_per_byte,none"] == pytest.approx(
        nll / nbytes / math.log(2), rel=1e-5
    )
