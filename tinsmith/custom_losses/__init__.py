"""Server-side custom losses: decoded from an uploaded torch.fx graph, run under an allow-list."""

from tinsmith.custom_losses.interpreter import RunLimits
from tinsmith.custom_losses.loss import BoundCustomLoss
from tinsmith.custom_losses.program import CustomLoss, decode_custom_loss

__all__ = ["BoundCustomLoss", "CustomLoss", "RunLimits", "decode_custom_loss"]
