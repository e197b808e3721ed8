import sys

from nanwatch.cli import main

sys.exit(main())
