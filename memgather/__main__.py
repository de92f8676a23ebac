import sys

from memgather.cli import main

sys.exit(main())
