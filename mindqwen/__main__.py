import sys

from mindqwen.cli import main

sys.exit(main())
