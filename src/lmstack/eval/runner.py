"""Run task files on a model: log-likelihoods through ``scoring``, generation through the engine (``LLM``),
metrics as lm-evaluation-harness defines them, standard errors, JSON and a table (CS336 notes "基准测试").

- multiple choice: ``acc`` = the option with the largest summed log-probability is the gold one;
  ``acc_norm`` = the same after dividing each option's log-probability by its length in characters
  (lm-eval's ``len(choice)``: bytes for ASCII text), which removes the bias towards short options;
- loglikelihood: ``loglik`` (mean summed log-probability of the continuation) and ``acc`` (greedy
  decoding reproduces the continuation);
- generate: ``exact_match`` of the extracted answer.

Standard errors are lm-eval's ``mean_stderr``: the sample standard deviation (n - 1) over sqrt(n); for a
0/1 metric that is the binomial sqrt(p(1 - p) / (n - 1)).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np

from lmstack.eval.scoring import RequestError, encode_pair, loglikelihoods, prefix_token_id
from lmstack.eval.tasks import Task
from lmstack.inference.llm import LLM
from lmstack.inference.sampling import SamplingParams


def mean_stderr(xs) -> float | None:
    xs = np.asarray(xs, dtype=np.float64)
    if len(xs) < 2:
        return None
    return float(xs.std(ddof=1) / math.sqrt(len(xs)))


@dataclass
class TaskResult:
    name: str
    kind: str
    n: int
    metrics: dict[str, float]
    stderr: dict[str, float | None]
    samples: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self, samples: bool = False) -> dict:
        d = {
            "name": self.name,
            "kind": self.kind,
            "n": self.n,
            "metrics": self.metrics,
            "stderr": self.stderr,
            "seconds": self.seconds,
        }
        if samples:
            d["samples"] = self.samples
        return d


class Evaluator:
    """A model and its tokenizer, with the three request types every runner (ours, lm-eval's) needs."""

    def __init__(
        self, model, tokenizer, max_length: int | None = None, max_batch_tokens: int = 8192
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_length = int(max_length or model.config.max_seq_len)
        self.max_batch_tokens = max_batch_tokens
        self._llm = None

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), greedy) per (context, continuation) string pair."""
        reqs = [encode_pair(self.tokenizer, c, x) for c, x in pairs]
        return self.loglikelihood_tokens(reqs)

    def loglikelihood_tokens(
        self, reqs: list[tuple[list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        prefix = (
            prefix_token_id(self.model, self.tokenizer) if any(not c for c, _ in reqs) else None
        )
        return loglikelihoods(
            self.model, reqs, self.max_length, prefix, max_batch_tokens=self.max_batch_tokens
        )

    def generate(
        self, prompts: list[str], stop: list[str], max_tokens: int, progress: bool = False
    ) -> list[str]:
        """Greedy continuations through the engine, cut at the first stop sequence; prompts longer than the
        context keep their last tokens (as lm-eval does)."""
        if self._llm is None:
            self._llm = LLM(self.model, self.tokenizer, max_model_len=self.max_length)
        keep = self.max_length - max_tokens
        if keep < 1:
            raise ValueError(
                f"max_tokens={max_tokens} leaves no room for a prompt in the context {self.max_length}"
            )
        ids = [self.tokenizer.encode(p)[-keep:] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(stop))
        outs = self._llm.generate(ids, params, use_tqdm=progress)
        return [cut_at_stop(o.text, stop) for o in outs]


def cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def extract(text: str, regex: str | None) -> str:
    """The answer in a generation: the regex's first group (or whole match), else the stripped text."""
    if regex is None:
        return text.strip()
    m = re.search(regex, text)
    if m is None:
        return "[invalid]"
    return (m.group(1) if m.groups() else m.group(0)).strip()


def run_task(task: Task, ev: Evaluator, progress: bool = True) -> TaskResult:
    t0 = time.perf_counter()
    prompts = task.prompts()
    samples: list[dict] = []
    if task.kind == "multiple_choice":
        pairs, owner = [], []
        for i, (it, p) in enumerate(zip(task.items, prompts)):
            for c in it.choices:
                pairs.append((p, task.target_delimiter + c))
                owner.append(i)
        lls = _batched(
            ev.loglikelihood,
            pairs,
            progress,
            f"{task.name} (options)",
            lambda k: f"{task.path}:{task.items[owner[k]].line}",
        )
        acc, acc_norm = [], []
        k = 0
        for it in task.items:
            ll = np.array([lls[k + j][0] for j in range(len(it.choices))])
            k += len(it.choices)
            lens = np.array([float(len(c)) for c in it.choices])
            pred, pred_norm = int(np.argmax(ll)), int(np.argmax(ll / lens))
            acc.append(float(pred == it.answer))
            acc_norm.append(float(pred_norm == it.answer))
            samples.append(
                {
                    "line": it.line,
                    "loglik": ll.tolist(),
                    "pred": pred,
                    "pred_norm": pred_norm,
                    "answer": it.answer,
                }
            )
        per = {"acc": acc, "acc_norm": acc_norm}
    elif task.kind == "loglikelihood":
        res = _batched(
            ev.loglikelihood,
            [(p, task.target_delimiter + it.continuation) for it, p in zip(task.items, prompts)],
            progress,
            task.name,
            lambda k: f"{task.path}:{task.items[k].line}",
        )
        for it, (ll, g) in zip(task.items, res):
            samples.append({"line": it.line, "loglik": ll, "greedy": g})
        per = {"loglik": [r[0] for r in res], "acc": [float(r[1]) for r in res]}
    else:
        texts = ev.generate(prompts, task.stop, task.max_tokens, progress)
        em = []
        for it, text in zip(task.items, texts):
            got = extract(text, task.regex)
            em.append(float(got == str(it.answer).strip()))
            samples.append({"line": it.line, "output": text, "extracted": got, "answer": it.answer})
        per = {"exact_match": em}
    return TaskResult(
        task.name,
        task.kind,
        len(task.items),
        {k: float(np.mean(v)) for k, v in per.items()},
        {k: mean_stderr(v) for k, v in per.items()},
        samples,
        time.perf_counter() - t0,
    )


def _batched(fn, pairs, progress: bool, desc: str, where=None, chunk: int = 64):
    """``fn`` over ``pairs`` in chunks; a request that cannot be scored is named by ``where(k)`` (its task
    file and line) instead of its index inside a chunk."""
    from tqdm import tqdm

    out = []
    with tqdm(total=len(pairs), desc=desc, disable=not progress) as bar:
        for i in range(0, len(pairs), chunk):
            try:
                out += fn(pairs[i : i + chunk])
            except RequestError as e:
                if where is None:
                    raise
                raise ValueError(f"{where(i + e.index)}: {e.reason}") from None
            bar.update(len(pairs[i : i + chunk]))
    return out


def table(results: list[TaskResult]) -> str:
    """A plain-text table: task, kind, n, metric, value ± stderr."""
    rows = [("task", "kind", "n", "metric", "value", "± stderr")]
    for r in results:
        for k, v in r.metrics.items():
            se = r.stderr.get(k)
            rows.append(
                (r.name, r.kind, str(r.n), k, f"{v:.4f}", f"{se:.4f}" if se is not None else "-")
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
