"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import futures, service, sessions, training

ROUTERS = [service.router, sessions.router, training.router, futures.router]
