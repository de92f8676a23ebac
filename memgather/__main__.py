import sys

from memgather.tools.cli import main

sys.exit(main())
