"""The loop as the serving process runs it: the scheduler, the offline gate, the A/B test, promotion, the leader
among replicas, and the training child it starts (its store-side steps go through ``core/store_api.py``)."""
