"""Runs an exported SavedModel's signature in a process that cannot import tfpipe.

    python serve_without_tfpipe.py SAVED_MODEL SIGNATURE INPUTS.npz OUTPUTS.npz

The repository and any tfpipe install (a path entry holding a `tfpipe` package,
or the import hook of `pip install -e`) are removed from sys.path and
sys.meta_path first, and `import tfpipe` must then fail: the SavedModel has to
stand on TensorFlow alone, as it would for a user who never installed tfpipe.
"""
import os
import sys


def _strip_tfpipe() -> None:
    sys.path[:] = [p for p in sys.path
                   if not os.path.isdir(os.path.join(p or os.getcwd(), 'tfpipe'))]
    sys.meta_path[:] = [f for f in sys.meta_path if 'tfpipe' not in
                        f'{type(f).__module__} {getattr(f, "__module__", "")} {f!r}'.lower()]
    sys.modules.pop('tfpipe', None)
    try:
        import tfpipe  # noqa: F401
    except ImportError:
        return
    raise SystemExit(f'tfpipe is still importable from {tfpipe.__file__}')


def main(saved_model: str, signature: str, inputs_path: str, outputs_path: str) -> None:
    _strip_tfpipe()
    import numpy as np
    import tensorflow as tf
    inputs = dict(np.load(inputs_path))
    loaded = tf.saved_model.load(saved_model)
    outputs = loaded.signatures[signature](**{k: tf.constant(v) for k, v in inputs.items()})
    np.savez(outputs_path, **{k: v.numpy() for k, v in outputs.items()})
    print('tfpipe modules loaded:', sorted(m for m in sys.modules if m.startswith('tfpipe')))


if __name__ == '__main__':
    main(*sys.argv[1:])
