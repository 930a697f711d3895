import sys

from swiftspec.entrypoints.cli import main

sys.exit(main())
