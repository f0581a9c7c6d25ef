import sys

from grpax.cli.main import main

sys.exit(main())
