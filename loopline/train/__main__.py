"""``python -m loopline.train pretrain ...`` = ``loopline train pretrain ...``."""
import sys

from loopline.train.cli import main

sys.exit(main())
