import sys

from aiopersist._cli import main

sys.exit(main())
