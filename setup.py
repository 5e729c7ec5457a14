"""tfpipe: config-driven TensorFlow 2 training with GPipe pipeline parallelism."""
from setuptools import find_packages, setup

setup(
    name='tfpipe',
    version='0.1.0',
    description='GPipe micro-batch pipeline parallelism for TensorFlow 2, Lingvo style',
    python_requires='>=3.10',
    packages=find_packages(include=['tfpipe', 'tfpipe.*', 'model_registry', 'model_registry.*',
                                    'params', 'params.*', 'trainer', 'trainer.*']),
    install_requires=[
        'numpy',
        'absl-py',
        'gin-config',
        'tensorflow-datasets',
        # tensorflow-datasets needs it to write datasets but does not declare it.
        'importlib_resources',
        # tf.summary raises TBNotInstalledError without it since TF 2.16.
        'tensorboard',
        # The timeline's Gantt PNG (tensorboard brings it too; matplotlib would be ~40 MB).
        'pillow',
    ],
    entry_points={'console_scripts': ['tfpipe-trainer = trainer.main:run']},
    extras_require={
        # TensorFlow is an extra so CPU-only machines avoid the 500 MB CUDA build.
        'cpu': ['tensorflow-cpu==2.21.*'],
        'gpu': ['tensorflow[and-cuda]==2.21.*'],
        # pytest-xdist: the suite runs in two processes (`-n 2`), its tests being mostly
        # single-threaded tracing and trainer subprocesses; serial it passes 12 minutes.
        # Pinned to a minor: tests/conftest.py's scheduler subclasses its LoadScopeScheduling.
        # ray[train]: tests/test_ray.py runs trainer clients as Ray Train workers.
        'test': ['pytest', 'pytest-xdist==3.8.*', 'ray[train]==2.60.0'],
        # Only benchmarks/table1_lm_benchmark.py's --plot (a line chart with axes, a legend
        # and a log scale: not worth drawing by hand with pillow).
        'plot': ['matplotlib'],
    },
)
