"""Hydra recipes. Each is run as a script (``python recipes/serve.py``); shared helpers live in
``recipes/_common.py`` (launching, settings, tables) and ``recipes/_outputs.py`` (the run dir),
imported as ``recipes._common`` / ``recipes._outputs``: each recipe puts the repository root, not its own directory, on ``sys.path``
(``recipes/profile.py`` would otherwise shadow the standard library's ``profile``)."""
