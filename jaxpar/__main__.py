import sys

from jaxpar.cli.main import main

sys.exit(main())
