import os

# The CPU allocator that keeps peak statistics, so the trainer can report the peak bytes
# per device (tfpipe/memory_stats.py); measured to cost no step time (docs/memory.md).
# Set before TensorFlow loads; an explicit TF_CPU_ALLOCATOR_USE_BFC=false wins.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')

from trainer.main import run  # noqa: E402

run()
