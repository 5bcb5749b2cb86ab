"""``python -m gateway`` is the ``flywheel`` command."""

from gateway.cli import main

main()
