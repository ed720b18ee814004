"""``python -m kvreplay``: the same command line as the ``kvreplay`` script."""

from kvreplay.cli import main

main()
