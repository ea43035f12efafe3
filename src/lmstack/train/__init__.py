"""Training: stable softmax/cross-entropy/z-loss, AdamW/SGD, clipping, LR schedules, memmap data,
packing, the Trainer (mixed precision, accumulation, checkpoints) and ``lmstack train``.

Book of LLMs §1.8 “training memory”, §5.1-5.4; CS336 notes "训练稳定性", "工程细节/基准测试", "模型规模定律".
"""

from lmstack.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lmstack.train.config import TrainConfig, TrainConfigError
from lmstack.train.data import (
    Batch,
    get_batch,
    pack_documents,
    pad_batch,
    sequential_batches,
    split_documents,
    token_budget_batches,
)
from lmstack.train.losses import IGNORE_INDEX, cross_entropy, load_balance_loss, z_loss_term
from lmstack.train.ops import log_softmax, logsumexp, softmax
from lmstack.train.optim import SGD, AdamW, clip_grad_norm, global_grad_norm
from lmstack.train.schedule import LRSchedule, cosine_lr, wsd_lr
from lmstack.train.trainer import Trainer, TrainingDiverged, unigram_baseline

__all__ = [
    "AdamW",
    "Batch",
    "CheckpointError",
    "IGNORE_INDEX",
    "LRSchedule",
    "SGD",
    "TrainConfig",
    "TrainConfigError",
    "Trainer",
    "TrainingDiverged",
    "clip_grad_norm",
    "cosine_lr",
    "cross_entropy",
    "get_batch",
    "global_grad_norm",
    "latest_checkpoint",
    "load_balance_loss",
    "load_checkpoint",
    "log_softmax",
    "logsumexp",
    "pack_documents",
    "pad_batch",
    "save_checkpoint",
    "sequential_batches",
    "softmax",
    "split_documents",
    "token_budget_batches",
    "unigram_baseline",
    "wsd_lr",
    "z_loss_term",
]
