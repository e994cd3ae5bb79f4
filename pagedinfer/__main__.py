"""``python -m pagedinfer`` runs the command line, as the ``pagedinfer`` script does."""

from pagedinfer.cli import main

main()
