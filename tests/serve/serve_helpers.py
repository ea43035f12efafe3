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
    """Run ``build_app(server)`` under uvicorn in a thread, as ``lmstack serve`` does (``http.uvicorn_server``);
    yields the base URL."""
    from lmstack.serve import build_app
    from lmstack.serve.http import uvicorn_server

    port = free_port()
    srv = uvicorn_server(build_app(server), server, "127.0.0.1", port, 5, log_level="warning")
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


def save_tiny_checkpoint(folder, max_seq_len: int = 256):
    """The tiny model (float32) and tokenizer saved as an lmstack checkpoint folder ``lmstack serve`` loads."""
    from lmstack.model.io import save_pretrained
    from lmstack.tokenizer import save_hf

    save_pretrained(tiny_model(max_seq_len=max_seq_len).to(torch.float32), folder)
    save_hf(tiny_tokenizer(), folder / "tokenizer.json")
    return folder


@contextlib.contextmanager
def cli_server(ckpt, *flags, timeout: float = 120.0):
    """``lmstack serve --model CKPT`` in a subprocess on 127.0.0.1 (one thread); yields (process, base URL)
    once /health answers; killed at the end if it is still running. Its log (stdout and stderr) is
    ``process.log()`` once it has exited."""
    import os
    import subprocess
    import sys

    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "lmstack", "serve", "--model", str(ckpt), "--port", str(port)]
    proc = subprocess.Popen(
        # eager decode step unless a test asks (compiling the buckets would dominate a test's time)
        [*cmd, "--threads", "1", "--compile", "off", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    proc.log = lambda: proc.stdout.read().decode()
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() - start > timeout:
                proc.kill()
                raise RuntimeError(f"lmstack serve did not start:\n{proc.log()}")
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
