import sys

from bsloss.cli import main

sys.exit(main())
