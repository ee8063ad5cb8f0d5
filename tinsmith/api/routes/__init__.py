"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import checkpoints, futures, sampling, service, sessions, training, usage

ROUTERS = [service.router, sessions.router, training.router, sampling.router, checkpoints.router, futures.router,
           usage.router]
