"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import checkpoints, futures, metrics, openai_compat, sampling, service, sessions, training

ROUTERS = [service.router, sessions.router, training.router, sampling.router, checkpoints.router, futures.router,
           metrics.router, *openai_compat.ROUTERS]
