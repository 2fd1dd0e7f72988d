"""``python -m loopline ...`` is the ``loopline`` command (for machines where its script is not on PATH)."""
import sys

from loopline.entrypoints.cli import main

sys.exit(main())
