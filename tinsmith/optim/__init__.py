"""Optimizer families a training run can be created with, and everything that depends on the
choice: validating ``optimizer_config``, building the torch optimizer of a trainable unit,
applying one step's hyperparameters, and which state tensors a checkpoint carries."""

from tinsmith.optim.families import (
    ADAMW,
    DIMUON,
    STATE_KEYS,
    SUPPORTED_OPTIMIZERS,
    apply_hyperparameters,
    build_optimizer,
    check_params_match,
    normalize_optimizer_config,
    optimizer_type,
    params_type,
    steps_on_device,
)

__all__ = [
    "ADAMW", "DIMUON", "STATE_KEYS", "SUPPORTED_OPTIMIZERS", "apply_hyperparameters", "build_optimizer",
    "check_params_match", "normalize_optimizer_config", "optimizer_type", "params_type",
    "steps_on_device",
]
