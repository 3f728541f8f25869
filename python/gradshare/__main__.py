import sys

from gradshare.cli import main

sys.exit(main())
