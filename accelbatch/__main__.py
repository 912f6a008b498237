from __future__ import annotations

import sys

from accelbatch.cli import main

sys.exit(main())
