"""HTTP routes, one module per area of the Tinker API."""

from tinsmith.api.routes import (checkpoints, custom_losses, dashboard, futures, metrics, openai_compat, sampling,
                                 service, sessions, training, usage)

# A request is matched against the routes in this order, one after another, and no path matches
# two routes (a test holds that): the routes every training or sampling loop calls all the time
# (futures, sampling, training) come first.
ROUTERS = [futures.router, sampling.router, training.router, sessions.router, service.router,
           custom_losses.router, checkpoints.router, usage.router, metrics.router, dashboard.router,
           *openai_compat.ROUTERS]
