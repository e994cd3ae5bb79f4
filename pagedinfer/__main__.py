"""``python -m pagedinfer`` runs the command line, as the ``pagedinfer`` script does."""

from pagedinfer.cli.app import app

app(prog_name="pagedinfer")
