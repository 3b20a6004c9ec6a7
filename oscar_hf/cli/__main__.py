"""``python -m oscar_hf.cli``: the ``oscar-hf`` command."""

from oscar_hf.cli.main import main

main()
