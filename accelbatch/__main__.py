import sys

from accelbatch.cli import main

sys.exit(main())
