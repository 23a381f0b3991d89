"""Hydra recipes. Each is run as a script (``python recipes/serve.py``); shared helpers live in
``recipes/_common.py`` and are imported as ``recipes._common``: each recipe puts the repository root, not its own directory, on ``sys.path``
(``recipes/profile.py`` would otherwise shadow the standard library's ``profile``)."""
