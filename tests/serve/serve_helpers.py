"""Helpers for the serving tests: a tiny random model with a byte-level tokenizer and a ChatML
template (float64, so no argmax near-tie flips between batch shapes), and a live uvicorn server
on 127.0.0.1 in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch

from lmstack.inference.engine import LLMEngine
from lmstack.model.config import ModelConfig
from lmstack.model.transformer import Transformer
from lmstack.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = "tiny"


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(
        {i: bytes([i]) for i in range(256)}, [], special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    tok.eos_token_id = tok.special_tokens["<|im_end|>"]
    tok.chat_template = CHATML
    return tok


def tiny_model(seed: int = 1, max_seq_len: int = 256) -> Transformer:
    cfg = ModelConfig(
        vocab_size=258,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        max_seq_len=max_seq_len,
        init_std=0.02,
    )
    return Transformer(cfg, dtype=torch.float64, seed=seed).eval()


def tiny_engine(model=None, **kw) -> LLMEngine:
    tok = tiny_tokenizer()
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 512)
    return LLMEngine(
        model if model is not None else tiny_model(), tok, eos_token_id=tok.eos_token_id, **kw
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(server, timeout: float = 30.0):
    """Run ``build_app(server)`` under uvicorn in a thread; yields the base URL."""
    import uvicorn

    from lmstack.serve import build_app

    port = free_port()
    config = uvicorn.Config(
        build_app(server),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    start = time.monotonic()
    while not srv.started:
        if not thread.is_alive() or time.monotonic() - start > timeout:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout)


def wait_idle(engine, timeout: float = 10.0) -> None:
    """Until the engine holds no request (aborts are applied between steps)."""
    start = time.monotonic()
    while engine.requests or engine.has_unfinished_requests():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"engine still holds {list(engine.requests)[:5]}")
        time.sleep(0.02)


def all_blocks_free(engine) -> bool:
    b = engine.cache.blocks
    return b.num_free == b.num_blocks - 1 and not b.tables


def route_table(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app answers (HEAD left out), routers included: FastAPI >= 0.16x
    keeps an included ``APIRouter`` as one entry of ``app.routes`` (its routes under ``original_router``)."""

    def walk(routes):
        for r in routes:
            sub = getattr(r, "original_router", None)
            if sub is not None:
                yield from walk(sub.routes)
            else:
                for m in sorted(getattr(r, "methods", None) or ()):
                    if m != "HEAD":
                        yield m, r.path

    return sorted(set(walk(app.routes)))
