"""Issue 27's last corner, T=4 x K=2 x R=2 on 16 devices, for the MLP and the LM.

The session's 8 logical CPUs (tests/conftest.py) hold every other corner
(tests/test_tensor_parallel.py, tests/test_tensor_parallel_lm.py); this one runs
for real in a child process with 16 (tests/tensor_parallel_16.py), which takes
each model's step there and at T=1 and reports the first mismatch.
"""
import json
import subprocess
import sys

from tests import trainer_helpers as th

DEVICES = sorted(f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in range(16))


def test_t4_k2_r2_on_16_devices_equals_t1():
    child = th.popen([sys.executable, '-m', 'tests.tensor_parallel_16'], th.env(),
                     subprocess.PIPE, subprocess.PIPE)
    try:
        stdout, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError(f'the 16-device child did not finish in 300 s:\n'
                             f'{child.communicate()[1][-3000:]}') from None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, stderr[-3000:]
    results = json.loads(stdout.strip().splitlines()[-1])
    assert sorted(results) == ['lm', 'mlp'], stdout[-3000:]
    for model, result in results.items():
        assert result['devices'] == DEVICES, (model, result['devices'])
    failures = [f'{model} at T=4, K=2, R=2 differs from T=1: {result["error"]}'
                for model, result in results.items() if result['error'] is not None]
    assert not failures, '\n'.join(failures) + f'\nchild stderr:\n{stderr[-3000:]}'
