import sys

from dwdp.cli import main

sys.exit(main())
