import sys

from swiftspec.cli import main

sys.exit(main())
