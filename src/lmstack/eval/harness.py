"""lm-evaluation-harness model class ``lmstack`` (CS336 notes "基准测试": the tool people actually run).

``LMStackLM`` is registered as ``lmstack`` in lm-eval's model registry. lm-eval reads no entry points,
so the installed package ships a .pth hook (``lmstack._lm_eval_hook``) that registers the lazy name
``lmstack.eval.harness:LMStackLM`` whenever ``lm_eval.models`` loads: lm-eval's own
``lm_eval --model lmstack --model_args model=smollm2-135m --tasks ...`` then works, as does
``lm_eval.simple_evaluate(model="lmstack", ...)``. Importing this module registers the class too (for an
interpreter without the hook), and ``lmstack eval harness ...`` is lm-eval's command line after that import.

The three request types run on lmstack's code: ``loglikelihood`` and ``loglikelihood_rolling`` through
``lmstack.eval.runner.Evaluator`` (batched ``Transformer.forward``; the context/continuation split
and the rolling windows are lm-eval's), ``generate_until`` through the paged engine (``LLM``), greedy.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (the built-in names first: lm-eval only imports them into an empty registry)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lmstack.eval.runner import Evaluator
from lmstack.eval.scoring import prefix_token_id
from lmstack.inference.loader import load_for_inference


def _int_or_none(v):
    return None if v in (None, "", "None") else int(v)


@register_model("lmstack")
class LMStackLM(LM):
    """``model``: a name (smollm2-135m), .gguf file, checkpoint dir, or a loaded Transformer; ``tokenizer``:
    a path or tokenizer object (default: the model's own); ``dtype``: fp32/bf16/int8/int4; ``max_length``:
    context (default the model's); ``max_gen_toks``: generation budget when a task names none."""

    def __init__(
        self,
        model="smollm2-135m",
        tokenizer=None,
        dtype="fp32",
        max_length=None,
        max_gen_toks=256,
        max_batch_tokens=8192,
        batch_size=None,
        device=None,
        max_batch_size=None,
        **unknown,
    ):
        super().__init__()
        if unknown:  # a typo (dtyp=int4) would otherwise run the defaults silently
            raise ValueError(
                f"lmstack model_args: unknown key(s) {sorted(unknown)}; expected model, tokenizer, dtype, "
                "max_length, max_gen_toks, max_batch_tokens (and lm-eval's batch_size, max_batch_size, "
                "device)"
            )

        import torch

        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"  # lm-eval's command line defaults to cuda:0; its HF class falls back the same way
        m, tok = load_for_inference(model, tokenizer, dtype, device=device)
        if tok is None:
            raise ValueError(
                "the lmstack lm-eval model needs a tokenizer (model_args tokenizer=PATH)"
            )
        self.ev = Evaluator(m, tok, _int_or_none(max_length), int(max_batch_tokens))
        self.max_gen_toks = int(max_gen_toks)

    @property
    def tokenizer_name(self) -> str:
        return "lmstack"

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [req.args for req in requests]
        out = []
        for i in tqdm(range(0, len(pairs), 64), disable=disable_tqdm, desc="lmstack loglikelihood"):
            out += self.ev.loglikelihood(pairs[i : i + 64])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every token of the string scored, in disjoint windows of the model's context (first from the
        prefix token), as lm-eval's HF class does; the sum per string."""
        ev = self.ev
        prefix = prefix_token_id(ev.model, ev.tokenizer)
        out = []
        for (string,) in tqdm(
            [r.args for r in requests], disable=disable_tqdm, desc="lmstack rolling"
        ):
            wins = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=ev.tokenizer.encode(string),
                    prefix_token=prefix,
                    max_seq_len=ev.max_length,
                    context_len=1,
                )
            ]
            out.append(sum(ll for ll, _ in ev.loglikelihood_tokens(wins)) if wins else 0.0)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation until any of ``until`` (or EOS), grouped by generation settings."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            ctx, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if kw.get("do_sample") and float(kw.get("temperature", 1.0)) > 0:
                raise ValueError(
                    "generate_until: the lmstack class decodes greedily (do_sample=True requested)"
                )
            key = (tuple(until), int(kw.get("max_gen_toks", self.max_gen_toks)))
            groups.setdefault(key, []).append(i)
        for (until, max_toks), idx in groups.items():
            texts = self.ev.generate(
                [requests[i].args[0] for i in idx], list(until), max_toks, progress=not disable_tqdm
            )
            for i, t in zip(idx, texts):
                out[i] = t
        return out  # type: ignore[return-value]


def run_lm_eval(argv: list[str]) -> None:
    """lm-eval's own command line with ``lmstack`` registered (``lm-eval run ARGS``)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    old = sys.argv
    sys.argv = [
        "lm-eval",
        *(argv if argv and argv[0] in ("run", "ls", "validate") else ["run", *argv]),
    ]
    try:
        cli_evaluate()
    finally:
        sys.argv = old
