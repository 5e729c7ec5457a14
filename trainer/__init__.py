"""The tfpipe trainer binary: train, eval and decode jobs over one logdir."""
