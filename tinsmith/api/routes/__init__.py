"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import futures, sampling, service, sessions, training

ROUTERS = [service.router, sessions.router, training.router, sampling.router, futures.router]
