"""The ``learner`` group's schema (conf/learner/), one per strategy picked by ``learner.kind``.

Types and range checks only (the defaults live in the YAML files); a field marked ``resumable`` may change
when a run is resumed (micro-batching, packing, memory and device knobs: the same loss up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo.infra.checks import ConfigError, choice, require, resumable

# learner.mixed_precision: FSDP2's compute dtype (bapo.learner.fsdp.wrap); here so that a config check needs no torch
MIXED_PRECISION = ("auto", "bf16", "fp32")

OLD_LOGP = ("rollout", "recompute")  # the engine's recorded log-probs | the learner's at the same version


@dataclass
class LearnerCommon:
    kind: str = MISSING
    lr: float = MISSING
    betas: list[float] = MISSING
    weight_decay: float = MISSING
    eps: float = MISSING
    warmup_steps: int = MISSING
    grad_clip: float = MISSING
    ppo_epochs: int = MISSING
    mini_batches_per_rollout: int = MISSING
    micro_batch_size: int = resumable()
    max_tokens_per_micro_batch: int | None = resumable()  # token budget per micro-batch (packed); null: by rows
    packing: bool = resumable()  # concatenate sequences (restarting position ids): no padding in the learner
    old_logp: str = MISSING  # rollout: the engine's recorded log-probs | recompute: the learner's, same version
    logp_check_share: float = resumable()  # old_logp=rollout: share of a batch's rows the learner re-scores to log
    #                                        rollout/logp_mismatch_* (at least one row; 0: off)
    max_consecutive_skips: int = resumable()  # stop after this many non-finite updates in a row

    def __post_init__(self) -> None:
        choice(self.old_logp, "learner.old_logp", OLD_LOGP)
        require(
            0 <= self.logp_check_share <= 1,
            "learner.logp_check_share",
            f"must be in [0, 1], got {self.logp_check_share}",
        )
        require(self.max_consecutive_skips >= 1, "learner.max_consecutive_skips", "must be >= 1")
        require(self.lr > 0, "learner.lr", f"must be > 0, got {self.lr}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "learner.betas", "two values in [0, 1)")
        require(self.weight_decay >= 0, "learner.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.eps > 0, "learner.eps", f"must be > 0, got {self.eps}")
        require(self.warmup_steps >= 0, "learner.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(self.grad_clip > 0, "learner.grad_clip", "must be > 0")
        require(self.ppo_epochs >= 1, "learner.ppo_epochs", "must be >= 1")
        require(self.mini_batches_per_rollout >= 1, "learner.mini_batches_per_rollout", "must be >= 1")
        require(self.micro_batch_size >= 1, "learner.micro_batch_size", "must be >= 1")
        require(
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
            "learner.max_tokens_per_micro_batch",
            "must be null or >= 1",
        )


@dataclass
class SingleLearnerConfig(LearnerCommon):
    """``learner=single``: one process."""

    device: str = resumable()  # auto | cpu | cuda | cuda:N

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_device(self.device)


@dataclass
class FSDPLearnerConfig(LearnerCommon):
    """``learner=fsdp``: FSDP2 over torchrun's ranks, one device per rank."""

    mixed_precision: str = MISSING  # auto (bf16 params + fp32 reduce on GPU, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = resumable()
    cpu_offload: bool = resumable()

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.mixed_precision, "learner.mixed_precision", MIXED_PRECISION)


LEARNER: dict[str, type] = {"single": SingleLearnerConfig, "fsdp": FSDPLearnerConfig}


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device("cpu" if device == "auto" else device)
    except RuntimeError:
        raise ConfigError(f"learner.device: {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    choice(dev.type, "learner.device", ("cpu", "cuda"))
    if dev.type == "cuda":
        require(torch.cuda.is_available(), "learner.device", f"{device!r} but this torch build sees no CUDA device")
        require(
            dev.index is None or dev.index < torch.cuda.device_count(),
            "learner.device",
            f"{device!r} but only {torch.cuda.device_count()} CUDA device(s)",
        )
