"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import (checkpoints, custom_losses, dashboard, futures, metrics, openai_compat, sampling,
                                 service, sessions, training, usage)

ROUTERS = [service.router, sessions.router, training.router, custom_losses.router, sampling.router,
           checkpoints.router, futures.router, usage.router, metrics.router, dashboard.router,
           *openai_compat.ROUTERS]
