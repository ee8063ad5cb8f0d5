"""HTTP routes, one module per area of the Tinker API, and the dashboard."""

from tinsmith.api.routes import checkpoints, dashboard, futures, sampling, service, sessions, training

ROUTERS = [service.router, sessions.router, training.router, sampling.router, checkpoints.router, futures.router,
           dashboard.router]
