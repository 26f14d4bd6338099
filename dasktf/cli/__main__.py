"""``python -m dasktf.cli``: the same as the ``dasktf`` command."""

from dasktf.cli import main

main()
