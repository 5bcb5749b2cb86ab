"""The dashboard at ``/flywheel/ui``: server-rendered pages over the loop and the trajectory store.

``gateway/serving/ui/routes.py`` installs it (``install(app, settings)``); ``session.py`` is its admin
login (a signed session cookie, or the admin key as a Bearer header); the pages read through the
store process (``gateway/storeproc/dashboard_ops.py``) and switch versions with the admin API's own
code. docs/dashboard.md describes the pages.
"""
