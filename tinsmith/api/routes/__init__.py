"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import (checkpoints, dashboard, futures, metrics, openai_compat, sampling, service, sessions,
                                 training)

ROUTERS = [service.router, sessions.router, training.router, sampling.router, checkpoints.router, futures.router,
           metrics.router, dashboard.router, *openai_compat.ROUTERS]
