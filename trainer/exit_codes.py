"""The trainer's exit statuses, shared by the trainer and the launcher that reads them.

A status says what a restart would do, so a supervisor (the launcher, a cluster
manager's retry policy) can decide without reading the error line's wording:
- EXIT_BAD_INPUT: flags, params, data, checkpoints or disk were refused; a restart
  refuses them again.
- EXIT_NON_FINITE: training met a NaN or Inf; a restart from the same checkpoint meets
  it again (training is deterministic), so it needs a change of the run (a lower
  learning rate, gradient clipping) rather than a retry.
Any other failure (1, 128+N for signal N) may be transient: a lost worker or client.
"""
EXIT_BAD_INPUT = 2
EXIT_NON_FINITE = 3
