"""`flash-catalog`: the command line, the demo and the tiny hosts it attaches to."""
