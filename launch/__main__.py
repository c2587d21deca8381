"""`python -m launch <command> <args>`: every make target's command (the table: launch/commands.py)."""

import sys

from launch import commands

sys.exit(commands.main())
