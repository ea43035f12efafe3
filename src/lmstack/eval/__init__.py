"""Evaluation (CS336 notes "基准测试"; Book of LLMs perplexity): perplexity and bits per byte, a task runner
(multiple choice, continuation log-likelihood, generation), the lm-evaluation-harness model class,
arena ratings (Elo, Bradley–Terry) from battles or from a pairwise judge, and contamination tests (exchangeability, n-gram overlap).
docs/eval.md."""

from .perplexity import PerplexityResult, bits_per_byte, perplexity, read_eval_tokens, windows
from .runner import Evaluator, TaskResult, run_task, table
from .scoring import RowScore, encode_pair, loglikelihoods, score_rows
from .tasks import Task, TaskError, load_task

__all__ = [
    "Evaluator",
    "Task",
    "TaskError",
    "TaskResult",
    "load_task",
    "run_task",
    "table",
    "PerplexityResult",
    "RowScore",
    "bits_per_byte",
    "encode_pair",
    "loglikelihoods",
    "perplexity",
    "read_eval_tokens",
    "score_rows",
    "windows",
]
