"""The entry points' machinery: the command line, the run folder and its lock, sweeps, and the launch of a node's
ranks. Everything here sits above the rest of the package."""
