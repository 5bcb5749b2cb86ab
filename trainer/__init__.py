"""Training side of Flywheel: the tiny offline model and fine-tuning jobs."""
