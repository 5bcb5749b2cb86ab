"""The store process: it owns the store file, records captured turns, serves the store-backed routes and runs the
loop's store-side operations (``storeproc/main.py`` is its entry point, ``python -m gateway.storeproc.main``)."""
