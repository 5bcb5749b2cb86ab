"""The training process: one round, start to end (``flywheel train``, the loop's training child, ``flywheel
trainer`` workers on other machines), talking to the gateway's admin API or to the store file."""
