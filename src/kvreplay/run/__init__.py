"""The application layer: what a command does, over every layer below. ``runner`` plans a
run and executes its units (the typed ``request`` it is asked with), ``check`` runs a
small run and gives its verdict (with its ``repro`` pack and ``outputs``), ``env``
rebuilds a run's environment, ``refeed`` makes cut-and-refeed items, ``summary`` prints
a run's table."""
