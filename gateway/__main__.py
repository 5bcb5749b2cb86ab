"""``python -m flywheel.gateway`` is the ``flywheel`` command."""

from flywheel.gateway.cli import main

main()
