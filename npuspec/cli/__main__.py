import sys

from npuspec.cli import main

sys.exit(main())
