"""The loop: training rounds, the scheduler, the promotion gate and its A/B test."""
