import sys

from recscale.cli import main

sys.exit(main())
