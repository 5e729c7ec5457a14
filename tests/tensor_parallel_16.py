"""Issue 27's (T=4, K=2, R=2) corner: 16 devices, so in a process of its own.

The test session has 8 logical CPUs (tests/conftest.py) and TensorFlow fixes its
devices when it starts, so tests/test_tensor_parallel_16.py runs this module in
a child process (`python -m tests.tensor_parallel_16`) that configures 16. It
takes the SGD step of tests/test_tensor_parallel.py's MLP and of
tests/test_tensor_parallel_lm.py's LM at T=4, K=2, R=2 and at T=1 (their shared
builders and comparisons: tests/tensor_parallel_mlp.py,
tests/tensor_parallel_lm_task.py), both models in this one process (a process
start costs seconds), and prints one JSON line: for each model the devices its
cells span and the first mismatch with T=1 (None when loss, gradients and
updated weights all agree).
"""
import json

import tfpipe

tfpipe.configure_logical_cpus(16)  # before any TensorFlow op

from tests import tensor_parallel_lm_task as lm_tp  # noqa: E402
from tests import tensor_parallel_mlp as mlp_tp  # noqa: E402

T, K, R = 4, 2, 2


def devices(pipe) -> list[str]:
    """Every device of every replica's cells (home and shard devices)."""
    return sorted({d for replica in pipe.replica_groups for slot in replica for d in slot})


def compare(pipe, check) -> dict:
    result = {'devices': devices(pipe), 'error': None}
    try:
        check()
    except AssertionError as e:
        result['error'] = str(e)
    return result


def main() -> None:
    # The MLP through the trainer's per-replica thetas, the LM through one theta onto
    # which the replicas' gradients are summed: both forms of a replicated step.
    pipe = mlp_tp.tp_pipeline(T, K, R)
    out = {'mlp': compare(pipe, lambda: mlp_tp.check(pipe, replica_thetas=True))}
    batch, ref = lm_tp.reference()
    task = lm_tp.lm_task(T, K, R)
    out['lm'] = compare(task.pipe, lambda: lm_tp.assert_same_step(lm_tp.sgd_step(task, batch),
                                                                    ref))
    print(json.dumps(out))


if __name__ == '__main__':
    main()
