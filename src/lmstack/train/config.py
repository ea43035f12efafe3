"""TrainConfig: everything a training run needs, from a TOML/JSON file plus ``key=value`` overrides.

A config file has flat training keys and a ``[model]`` table (ModelConfig fields, or
``preset = "smollm2-135m"`` plus overrides)::

    train_data = "data/train.bin"
    batch_size = 16          # B, sequences per micro-batch
    seq_len = 256            # S
    grad_accum = 2           # micro-batches per optimizer step
    lr = 3e-3
    [model]
    d_model = 256
    n_layers = 4
    n_heads = 4

Every value is checked in ``__post_init__``; a bad one raises ``TrainConfigError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmstack.cpu import TRAIN_PRECISIONS
from lmstack.kernels.runtime import RuntimeConfig
from lmstack.model.config import RUNTIME_FIELDS, ConfigError, ModelConfig
from lmstack.parallel.plan import ParallelPlan
from lmstack.train.schedule import SCHEDULES
from lmstack.utils import atomic_write_text, check_bool, check_int

OPTIMIZERS = ("adamw", "sgd")


class TrainConfigError(ValueError):
    """A training configuration value that cannot work."""


@dataclass
class TrainConfig:
    # ---- model: ModelConfig fields, or {"preset": name, ...overrides}; vocab_size defaults to the data's V
    model: dict[str, Any] = field(default_factory=dict)
    # ---- data (Book of LLMs §5.3 “memmap loading and bf16/int8 weights”): flat token files from `lmstack tokenizer encode`
    train_data: str = ""
    val_data: str | None = None  # None: hold out the last val_fraction of train_data
    val_fraction: float = 0.05
    tokenizer: str | None = None  # recorded in checkpoints; used by `lmstack train` to sample
    sep_id: int | None = None  # document separator id (<|endoftext|>), needed for packing
    packing: bool = False  # attention never crosses a separator (CS336 notes packing mask)
    # ---- batch: tokens per optimizer step = batch_size * grad_accum * seq_len
    batch_size: int = 8  # B per micro-batch
    seq_len: int = 256  # S
    grad_accum: int = 1
    # ---- optimization
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    schedule: str = "cosine"
    warmup_steps: int = 100
    decay_steps: int = 0  # wsd
    max_steps: int = 1000
    weight_decay: float = 0.1  # on matrices only; norms/biases never decay
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    grad_clip: float = 1.0  # 0 disables clipping
    z_loss: float = 0.0  # α of α·log²Z (CS336 notes "训练稳定性"); 1e-4 is typical
    qk_norm: bool | None = None  # shortcut for model.qk_norm
    # ---- precision and memory (Book of LLMs §1.8 “training memory”, §5.1-5.4)
    # auto: bf16 autocast where the CPU multiplies bf16 natively and measures faster, else fp32 (lmstack.cpu);
    # bf16/fp16: autocast with fp32 master weights; fp32: no autocast
    precision: str = "auto"
    activation_checkpointing: bool = False
    device: str = "auto"
    compile: bool = False  # torch.compile the model
    # runtime choices (lmstack.kernels.runtime.RuntimeConfig); ``[model] attn_backend = ...`` is still read
    attn_backend: str = "auto"  # auto | sdpa | reference | matmul | flash_pytorch | flash_triton
    norm_backend: str = "auto"  # auto | torch | triton
    fused_loss: bool = (
        True  # unembedding + cross-entropy block by block, never the (B·S, V) logits (losses.py)
    )
    quant: str | None = (
        None  # "int4-qat": quantisation-aware training, fake-quantised block linears (quant/qat.py)
    )
    # ---- evaluation, logging, checkpoints
    eval_interval: int = 100
    eval_batches: int = 20
    log_interval: int = 10
    out_dir: str = "runs/lmstack"
    ckpt_interval: int = 0  # 0: only at the end
    keep_last: int = 2
    seed: int = 0
    stop_after: int | None = (
        None  # stop (and checkpoint) after this many steps without changing the schedule
    )
    time_limit_s: float | None = (
        None  # stop (and checkpoint) once training has run this long (wall clock)
    )
    # ---- distributed: a lmstack.parallel plan, as a table ({dp = 2, tp = 2, zero = 1}) or a string
    # ("ddp", "zero1", "dp=2,tp=2,zero=1"); None = one process. Launch with torchrun (docs/parallel.md).
    parallel: str | dict[str, Any] | None = None
    dist_timeout_s: float = (
        600.0  # a collective waiting longer than this for a stalled rank fails the run
    )

    def __post_init__(self) -> None:
        def pos_int(name: str, allow_zero: bool = False) -> None:
            setattr(
                self,
                name,
                check_int(name, getattr(self, name), TrainConfigError, 0 if allow_zero else 1),
            )

        def num(name: str, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or (v <= lo if lo_open else v < lo)
                or (hi is not None and v >= hi)
            ):
                raise TrainConfigError(
                    f"{name}={v!r} must be a number in {'(' if lo_open else '['}{lo}, "
                    f"{hi if hi is not None else 'inf'})"
                )

        for n in ("packing", "activation_checkpointing", "compile", "fused_loss"):
            check_bool(n, getattr(self, n), TrainConfigError)
        if self.quant not in (None, "int4-qat"):
            raise TrainConfigError(
                f'quant={self.quant!r}; expected "int4-qat" (quantisation-aware training) or '
                "null (post-training quantisation: `lmstack generate --dtype int4`, `LLM(quant=...)`)"
            )
        if self.precision not in TRAIN_PRECISIONS:
            raise TrainConfigError(
                f"precision={self.precision!r}; expected one of {TRAIN_PRECISIONS}"
            )
        self._move_runtime_keys()
        if self.qk_norm is not None:
            check_bool("qk_norm", self.qk_norm, TrainConfigError)
        for n in ("train_data", "out_dir", "device"):
            if not isinstance(getattr(self, n), str):
                raise TrainConfigError(f"{n}={getattr(self, n)!r} must be a string")
        for n in ("val_data", "tokenizer"):
            if getattr(self, n) is not None and not isinstance(getattr(self, n), str):
                raise TrainConfigError(
                    f"{n}={getattr(self, n)!r} must be a path (a string) or null"
                )
        if self.sep_id is not None:
            pos_int("sep_id", allow_zero=True)
        for n in (
            "batch_size",
            "seq_len",
            "grad_accum",
            "max_steps",
            "eval_batches",
            "log_interval",
            "keep_last",
        ):
            pos_int(n)
        for n in ("warmup_steps", "decay_steps", "eval_interval", "ckpt_interval", "seed"):
            pos_int(n, allow_zero=True)
        num("lr", 0.0, lo_open=True)
        num("min_lr", 0.0)
        if self.min_lr > self.lr:
            raise TrainConfigError(f"min_lr={self.min_lr} must be <= lr={self.lr}")
        num("weight_decay", 0.0)
        num("beta1", 0.0, 1.0)
        num("beta2", 0.0, 1.0)
        num("eps", 0.0)
        num("momentum", 0.0, 1.0)
        num("grad_clip", 0.0)
        num("z_loss", 0.0)
        num("val_fraction", 0.0, 1.0)
        num("dist_timeout_s", 0.0, lo_open=True)
        if self.warmup_steps > self.max_steps:
            raise TrainConfigError(
                f"warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise TrainConfigError(f"optimizer={self.optimizer!r}; expected one of {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            raise TrainConfigError(f"schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if self.schedule == "wsd" and not (
            1 <= self.decay_steps <= self.max_steps - self.warmup_steps
        ):
            raise TrainConfigError(
                f"decay_steps={self.decay_steps} must be in [1, max_steps - warmup_steps] "
                "for schedule='wsd'"
            )
        if not isinstance(self.model, dict):
            raise TrainConfigError(f"model={self.model!r} must be a table of ModelConfig fields")
        if self.packing and self.sep_id is None:
            raise TrainConfigError(
                "packing=true needs sep_id (the id of the document separator, e.g. <|endoftext|>)"
            )
        if self.stop_after is not None:
            pos_int("stop_after")
        if self.time_limit_s is not None:
            num("time_limit_s", 0.0, lo_open=True)
        if self.parallel is not None:
            if not isinstance(self.parallel, (str, dict)):
                raise TrainConfigError(
                    f"parallel={self.parallel!r} must be a table (e.g. {{dp = 2, zero = 1}}) "
                    "or a string (e.g. 'ddp' or 'dp=2,tp=2')"
                )
            try:
                ParallelPlan.parse(self.parallel)
            except (ValueError, TypeError) as e:
                raise TrainConfigError(f"parallel={self.parallel!r}: {e}") from None
        if not self.train_data:
            raise TrainConfigError(
                "train_data is required: a token file from `lmstack tokenizer encode`"
            )

    def _move_runtime_keys(self) -> None:
        """``[model] attn_backend/norm_backend`` (the spelling before RuntimeConfig) become the top-level keys."""
        if isinstance(self.model, dict):
            self.model = dict(self.model)  # not the caller's table
            for key in RUNTIME_FIELDS:
                if key in self.model:
                    value = self.model.pop(key)
                    if getattr(self, key) not in ("auto", value):
                        raise TrainConfigError(
                            f"model.{key}={value!r} and {key}={getattr(self, key)!r} disagree; "
                            f"{key} is a runtime choice now: set only the top-level {key}"
                        )
                    setattr(self, key, value)
        try:
            self.runtime()
        except ValueError as e:
            raise TrainConfigError(str(e)) from None

    def runtime(self) -> RuntimeConfig:
        """How this run computes: backends, precision, compile (resolved once by the trainer,
        ``lmstack.kernels.runtime.configure``). The TOML keeps them as top-level keys. The Trainer resolves
        ``precision="auto"`` (``lmstack.cpu.choose_precision``) before it asks; unresolved, auto reads as fp32."""
        dtype = "fp32" if self.precision == "auto" else self.precision
        return RuntimeConfig(
            self.attn_backend, self.norm_backend, dtype=dtype, compile=self.compile
        )

    # ---- model ---------------------------------------------------------------------------
    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig this run trains; ``vocab_size`` (from the data) fills a missing V."""
        d = dict(self.model)
        preset = d.pop("preset", None)
        if self.qk_norm is not None:
            d["qk_norm"] = self.qk_norm
        try:
            if preset is not None:
                cfg = ModelConfig.from_preset(preset, **d)
            else:
                if "vocab_size" not in d and vocab_size is not None:
                    d["vocab_size"] = vocab_size
                cfg = ModelConfig.from_dict(d)
        except (ConfigError, TypeError) as e:
            raise TrainConfigError(f"model: {e}") from None
        if self.seq_len > cfg.max_seq_len:
            raise TrainConfigError(
                f"seq_len={self.seq_len} exceeds model.max_seq_len={cfg.max_seq_len}"
            )
        if self.sep_id is not None and self.sep_id >= cfg.vocab_size:
            raise TrainConfigError(
                f"sep_id={self.sep_id} is not a token id of the model (vocab_size="
                f"{cfg.vocab_size}: ids 0..{cfg.vocab_size - 1})"
            )
        return cfg

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrainConfigError(
                f"{where}: unknown key(s) {unknown}; known keys: {sorted(known)}"
            )
        return cls(**d)

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
        """Read a ``.toml`` or ``.json`` file, apply ``key=value`` overrides, validate."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        text = p.read_text(encoding="utf-8")
        try:
            d = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise TrainConfigError(f"{p}: cannot parse ({e})") from None
        if not isinstance(d, dict):
            raise TrainConfigError(f"{p}: expected a table/object at the top level")
        apply_overrides(d, overrides or [])
        return cls.from_dict(d, where=str(p))

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def parse_value(text: str) -> Any:
    """``3e-4`` -> float, ``true`` -> True, ``null`` -> None, ``[1,2]`` -> list, else the string."""
    low = text.strip()
    if low in ("true", "True"):
        return True
    if low in ("false", "False"):
        return False
    if low in ("null", "None", "none"):
        return None
    try:
        return json.loads(low)
    except json.JSONDecodeError:
        return text


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``model.key=value`` strings to the raw config dict in place."""
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(
                f"override {item!r} must look like key=value (e.g. lr=3e-4 or model.n_layers=4)"
            )
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        target = d
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise TrainConfigError(f"override {item!r}: {part!r} is not a table")
        target[parts[-1]] = parse_value(value)
    return d
