"""The store process: it owns the store file, records captured turns, serves the store-backed routes and runs the
loop's store-side operations (its entry point: ``python -m flywheel.gateway.storeproc.main``)."""
