"""The tfpipe trainer binary: train, eval and decode jobs over one logdir."""
import os

# The CPU allocator that keeps peak statistics, so the trainer can report the peak bytes
# per device (tfpipe/memory_stats.py); measured to cost no step time (docs/memory.md).
# It must be set before TensorFlow loads, and both entry points (`python -m trainer` and the
# tfpipe-trainer console script, trainer.main:run) import this package first. An explicit
# TF_CPU_ALLOCATOR_USE_BFC=false wins; a process that loaded TensorFlow already keeps its own.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
