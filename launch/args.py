"""The one argument parser of the entry points: a bad argument is one line on stderr and exit 2 (bad input), like
every other bad request, instead of argparse's usage block."""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)
