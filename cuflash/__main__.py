"""``python -m cuflash`` runs the command-line interface."""

from .cli import main

main()
