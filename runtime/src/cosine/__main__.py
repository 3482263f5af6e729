import sys

from cosine.cli import main

sys.exit(main())
