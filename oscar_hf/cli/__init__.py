"""The ``oscar-hf`` command line (:func:`oscar_hf.cli.main.main`)."""
