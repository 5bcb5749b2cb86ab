"""The store-backed routes: served by the store process, forwarded unchanged by the gateway (same paths)."""

from flywheel.gateway.storeproc.routes import checkpoints, feedback, groups, stored, trajectories

STORE_ROUTERS = (stored.router, trajectories.router, feedback.router, groups.router, checkpoints.router)
